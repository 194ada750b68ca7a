"""Plan before you run: every rank's peak memory for each strategy and world size.

    python -m sharded_exp.plan model=gpt_7b trainer.batch_size=1 plan.world_sizes=[8,64]
    python -m sharded_exp.plan model=hf_llama plan.find=batch_size plan.device_memory_gib=0.5
    python -m sharded_exp.plan plan.params=7.5e9 plan.world_sizes=[64] precision=16
    python -m sharded_exp.plan model=gpt2_xl precision=bf16 plan.strategies=[ddp,fsdp]
    python -m sharded_exp.plan model=gpt_7b trainer.batch_size=1 plan.world_sizes=[1,8,64] plan.plot=plan.png

Same config groups and overrides as training (its own primary config, ``conf/plan.yaml``,
adds the ``plan`` settings). For a configured model, each (strategy, world size) point is
one fake training step (:mod:`sharded_exp.predict.fake_step`): the very prediction every run
makes in its parent, so every run checks the planner. For a raw parameter count
(``plan.params``) there is no model to run: the count is an ideally divisible model
(``plan.units`` equal blocks, each split into one equal tensor per rank: the ZeRO paper's
assumption) under each strategy's analytic memory model, without activations.

``plan.find=batch_size`` adds the largest per-rank batch that fits
``plan.device_memory_gib``; ``plan.find=depth`` the deepest GPT at the configured width.
``plan.find=fastest`` names the fastest configuration that fits per world size (strategy x
lever x micro-batch x HSDP replicate) with the command that runs it. Every point also has
its predicted step time (``step_time_s``, ``exposed_comm_s``, ``tokens_per_s_per_device``,
``mfu_pct``) on ``plan.device_profile`` (:mod:`~sharded_exp.plan.speed`).
``plan.plot=plan.png`` also draws the plan (peak per rank vs world size per strategy,
the device memory as a line).

The package: :mod:`~sharded_exp.plan.command` (the command line, Hydra's questions without
torch), :mod:`~sharded_exp.plan.points` (the planned points), :mod:`~sharded_exp.plan.depth`
(a deep model composed from shallow fake steps), :mod:`~sharded_exp.plan.table` (the
formats), :mod:`~sharded_exp.plan.speed` (the speed columns), :mod:`~sharded_exp.plan.fastest`
(``plan.find=fastest``), :mod:`~sharded_exp.plan.progress` (the progress bar).
"""
