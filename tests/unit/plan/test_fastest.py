"""plan.find=fastest's search space and the command line it answers with."""

from __future__ import annotations

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
