"""plan.find=fastest's search space and the command line it answers with."""

from __future__ import annotations

import io

from omegaconf import OmegaConf

from sharded_exp.plan import fastest


def test_micro_batches_are_the_power_of_two_divisors_and_the_whole():
    assert fastest.micro_batches(12) == [12, 4, 2, 1]
    assert fastest.micro_batches(1) == [1]


def test_hsdp_is_tried_with_one_replica_per_node_for_a_strategy_that_has_replicate():
    cfg = OmegaConf.create({"plan": {"gpus_per_node": 8}})
    assert fastest.replicas(cfg, "fsdp", 64) == [1, 8]
    assert fastest.replicas(cfg, "fsdp", 8) == [1]
    assert fastest.replicas(cfg, "ddp", 64) == [1]


def test_the_command_line_runs_the_candidate():
    c = OmegaConf.create({"precision": {"name": "bf16"}, "optimizer": {"name": "adamw"},
                          "strategy": {"name": "fsdp", "replicate": 8},
                          "trainer": {"batch_size": 2, "grad_accum": 4}})  # fmt: skip
    line = fastest.command("model=gpt_7b", c, c, "ac", 64)
    assert line == ("sharded-exp model=gpt_7b precision=bf16 optimizer=adamw strategy=fsdp trainer.world_size=64 "
                    "trainer.batch_size=2 trainer.grad_accum=4 trainer.activation_checkpointing=full "
                    "strategy.replicate=8")  # fmt: skip


def test_the_command_line_keeps_the_overrides_the_plan_was_made_with():
    """The plan's own settings and the model's keys are not a run's; the configured strategy's
    settings go with it only where it won (the others were planned at their defaults); what
    the candidate sets is written once, after them."""
    argv = ["model=gpt", "model.n_layers=4", "plan.find=fastest", "+plan.workers=1", "hydra.verbose=true", "hydra/launcher=basic",
            "trainer.grad_clip=0", "+optimizer.foreach=false", "strategy=fsdp", "strategy.param_dtype=float32",
            "strategy.replicate=2", "trainer.batch_size=8", "precision=bf16"]  # fmt: skip
    given = fastest.run_overrides(argv)
    assert given == ["trainer.grad_clip=0", "+optimizer.foreach=false", "strategy=fsdp", "strategy.param_dtype=float32",
                     "strategy.replicate=2", "trainer.batch_size=8", "precision=bf16"]  # fmt: skip
    cfg = OmegaConf.create({"strategy": {"name": "fsdp"}})
    won = OmegaConf.create({"precision": {"name": "bf16"}, "optimizer": {"name": "adam"},
                            "strategy": {"name": "fsdp", "replicate": 8}, "trainer": {"batch_size": 2, "grad_accum": 4}})  # fmt: skip
    assert fastest.command("model=gpt model.n_layers=4", cfg, won, "none", 64, given) == (
        "sharded-exp model=gpt model.n_layers=4 trainer.grad_clip=0 +optimizer.foreach=false strategy.param_dtype=float32 "
        "precision=bf16 optimizer=adam strategy=fsdp trainer.world_size=64 trainer.batch_size=2 trainer.grad_accum=4 "
        "strategy.replicate=8"
    )
    quoted = fastest.command("model=gpt", cfg, won, "none", 8, ["trainer.freeze=[embed*]", "+model.note=a b"])
    assert quoted.startswith("sharded-exp model=gpt 'trainer.freeze=[embed*]' '+model.note=a b' precision=bf16")
    other = won.copy()
    other.strategy = {"name": "ddp"}
    assert fastest.command("model=gpt", cfg, other, "none", 8, given) == (
        "sharded-exp model=gpt trainer.grad_clip=0 +optimizer.foreach=false precision=bf16 optimizer=adam strategy=ddp "
        "trainer.world_size=8 trainer.batch_size=2 trainer.grad_accum=4"
    )


def test_each_candidate_is_planned_once_for_every_world_size_it_is_tried_at(plan_cfg, monkeypatch):
    """ddp and fsdp, a global batch of 4 (micro-batches 4, 2, 1), at 8 and 64 ranks of 8 GPUs a
    node: fsdp is also tried as HSDP at 64 (one replica per node), a candidate of that world size
    alone. Each candidate is planned once, its rows at both world sizes; the fastest that fits
    wins per world size, the first of equals in the search's order."""
    from sharded_exp.plan.progress import Progress

    c = plan_cfg.copy()
    c.plan.strategies, c.plan.world_sizes, c.plan.gpus_per_node = ["ddp", "fsdp"], [8, 64], 8
    c.trainer.batch_size, c.trainer.grad_accum = 4, 1
    planned = []

    def rows(c, name, combo, world_sizes, device_type):  # made up: fsdp fits only at batch 1, ddp never at 64
        b, r = int(c.trainer.batch_size), int(c.strategy.get("replicate", 1) or 1)
        planned.append((name, b, r, list(world_sizes)))
        fit = lambda ws: b == 1 if name == "fsdp" else ws == 8  # noqa: E731
        return [{"strategy": name, "levers": combo, "fits": fit(ws), "step_time_s": 1.0 / b + r, "total_gib": 1.0}
                for ws in world_sizes]  # fmt: skip

    monkeypatch.setattr(fastest, "task_rows", rows)
    progress = Progress(10, io.StringIO())
    found = fastest.fastest_rows(c, [8, 64], "cpu", progress, "model=mlp")
    assert sorted(planned) == sorted([("ddp", b, 1, [8, 64]) for b in (4, 2, 1)] +
                                     [("fsdp", b, 1, [8, 64]) for b in (4, 2, 1)] + [("fsdp", b, 8, [64]) for b in (4, 2, 1)])  # fmt: skip
    assert planned[0][0] == "fsdp"  # the costliest strategy first
    assert progress.count == 9
    at8, at64 = found
    assert (at8["strategy"], at8["batch_size"], at8["grad_accum"]) == ("ddp", 4, 1)  # 1.25 s a step
    assert (at64["strategy"], at64["batch_size"], at64["replicate"]) == ("fsdp", 1, 1)  # 2 s; as HSDP 9 s
    assert at8["note"] == "fastest of 6 candidates" and at64["note"] == "fastest of 9 candidates"


def test_of_equally_fast_candidates_the_first_in_the_search_wins_whichever_was_planned_first(plan_cfg, monkeypatch):
    """ddp and fsdp both fit at 2 s a step: the search lists ddp first, the planning plans fsdp
    first (the costliest first); ddp is the answer."""
    c = plan_cfg.copy()
    c.plan.strategies, c.plan.world_sizes = ["ddp", "fsdp"], [8]
    c.trainer.batch_size, c.trainer.grad_accum = 1, 1
    planned = []

    def rows(c, name, combo, world_sizes, device_type):
        planned.append(name)
        return [{"strategy": name, "levers": combo, "fits": True, "step_time_s": 2.0, "total_gib": 1.0}]

    monkeypatch.setattr(fastest, "task_rows", rows)
    (found,) = fastest.fastest_rows(c, [8], "cpu")
    assert planned == ["fsdp", "ddp"] and found["strategy"] == "ddp"
