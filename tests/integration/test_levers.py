"""The levers beyond sharding (issue 24), each held like a strategy: parity, measured and
predicted peak, the planner, and a clear refusal where a lever cannot apply.

Parity: activation checkpointing (full, selective, every 2nd unit) against the same
strategy without it, bit for bit, for every strategy (the GPT parity runs of
``tests/integration/test_matrix.py`` are the references, shared); HSDP against FSDP at 4 ranks;
compile against eager. The default tier runs each strategy with one lever (rotating); the
rest of the product is ``-m slow``, with compile against eager for every strategy.
"""

from __future__ import annotations

import json

import pytest

from sharded_exp.compose import compose
from sharded_exp.errors import ConfigError
from tests.helpers.jobs import STRATEGY_NAMES, tiny
from tests.helpers.overrides import PARITY, PARITY_MODELS
from tests.helpers.runs import check_run
from tests.helpers.states import max_relative_diff

AC = {
    "full": ["trainer.activation_checkpointing=full"],
    "selective": ["trainer.activation_checkpointing=selective"],
    "every_2": ["trainer.activation_checkpointing=full", "trainer.ac_every=2"],
}
BASE = [*PARITY_MODELS["gpt"], *PARITY]  # the GPT parity runs' overrides: their reference runs are shared


def _combos():
    for i, strategy in enumerate(STRATEGY_NAMES):
        for j, lever in enumerate(AC):
            marks = () if j == i % len(AC) else (pytest.mark.slow,)
            yield pytest.param(strategy, lever, marks=marks, id=f"{strategy}-{lever}")


def activations(result) -> float:
    return max(r["peak_breakdown_mib"]["Activation"] for r in result["memory"]["per_rank"])


@pytest.mark.parametrize("strategy, lever", list(_combos()))
def test_activation_checkpointing_changes_no_parameter(strategy, lever, shared_runs):
    """Recomputation is deterministic (torch restores the RNG state for dropout): the final
    model equals the run without checkpointing bit for bit; the saving shows in the
    measured activations, and the fake step predicts the checkpointed peak within 10%."""
    ref_dir, ref = shared_runs(f"strategy={strategy}", *BASE)
    out, result = shared_runs(f"strategy={strategy}", *BASE, *AC[lever])
    check_run(result, [])
    assert max_relative_diff(out, ref_dir) == 0.0
    assert result["param_digest"] == ref["param_digest"] and result["final_loss"] == ref["final_loss"]
    assert activations(result) < activations(ref)
    assert result["config"]["trainer"]["activation_checkpointing"] == AC[lever][0].split("=")[1]


@pytest.mark.slow  # HSDP's real runs in the default tier: test_coverage.py's fsdp and fsdp_grad_op (strategy.replicate=2)
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_grad_op"])
def test_hsdp_matches_fsdp_and_shards_within_a_replica_group(strategy, shared_runs):
    """strategy.replicate=2 at 4 ranks: a 2 x 2 mesh. Each rank holds half the states (a
    group of 2 shards them), twice FSDP's at 4 ranks; training matches FSDP's up to the
    order of the gradient sums (reduce-scatter in a group, then all-reduce across groups:
    2.4e-5 after 8 Adam steps, where one 4-rank reduce-scatter against DDP stays within 1e-6)."""
    four = ["trainer.world_size=4"]
    ref_dir, ref = shared_runs(f"strategy={strategy}", *BASE, *four)
    out, hsdp = shared_runs(f"strategy={strategy}", *BASE, *four, "strategy.replicate=2")
    check_run(hsdp, [])
    assert max_relative_diff(out, ref_dir) <= 1e-4
    assert hsdp["param_digest"]["l2"] == pytest.approx(ref["param_digest"]["l2"], rel=1e-6)
    states = [sum(r["model_states_mib"].values()) for r in hsdp["memory"]["per_rank"]]
    ref_states = [sum(r["model_states_mib"].values()) for r in ref["memory"]["per_rank"]]
    assert max(states) == pytest.approx(2 * max(ref_states), rel=0.1)


def test_fsdp_mixed_precision_knobs_compute_in_the_dtype_asked(shared_runs):
    """precision=32 with strategy.param_dtype=bfloat16: FSDP computes in bf16 (the final
    model differs from the fp32 run's, by less than 5%), trains, and its states and peak
    are predicted as for any run (check_run)."""
    ref_dir, ref = shared_runs("strategy=fsdp", *BASE)
    out, half = shared_runs("strategy=fsdp", *BASE, "strategy.param_dtype=bfloat16", "strategy.reduce_dtype=float32")
    check_run(half, [])
    assert 0 < max_relative_diff(out, ref_dir) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_compile_matches_eager_and_reports_compile_time(strategy, shared_runs):
    """Each strategy with its units compiled: parameters within 1e-5 of eager; the
    compiling step is outside the timed ones and its extra time is compile_s. SGD: under
    Adam the key biases (whose gradient is zero up to rounding: softmax ignores a shift)
    take lr-sized steps on rounding noise, which inductor's fused kernels round otherwise
    (3e-5 on qkv.bias after 8 steps; every other tensor within 1.3e-7)."""
    sgd = [*BASE, "optimizer=sgd", "optimizer.momentum=0.9", "optimizer.lr=0.05"]
    eager_dir, eager = shared_runs(f"strategy={strategy}", *sgd)
    # (a cold compile can keep one rank from the first collective for long: a generous timeout)
    out, compiled = shared_runs(f"strategy={strategy}", *sgd, "trainer.compile=true", "trainer.timeout_s=300")
    check_run(compiled, [])
    assert max_relative_diff(out, eager_dir) <= 1e-5
    tp = compiled["throughput"]
    assert tp["compile_s"] > 0 and tp["first_step_s"] > tp["step_time_s_median"]
    assert "faked eager" in compiled["memory"]["peak_prediction"]["note"]


@pytest.mark.slow
def test_activation_checkpointing_at_4_ranks_is_predicted_within_10_percent(shared_runs):
    _, result = shared_runs("strategy=fsdp", *BASE, "trainer.world_size=4", *AC["selective"])
    check_run(result, [])  # |predicted - measured| <= 10% on every rank


# ------------------------------------------------------------------ refusals, before spawn
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy=fsdp", "strategy.cpu_offload=true"],
         r"strategy.cpu_offload=true moves states from the GPU to host memory; this run is on cpu"),
        (["strategy=fsdp_grad_op", "strategy.replicate=3", "trainer.world_size=4"],
         r"strategy.replicate=3 must divide trainer.world_size=4 \(HSDP: .*divisors: 1, 2, 4\)"),
        (["model=custom", "model._target_=tests.helpers.user_models.build_flat", "trainer.activation_checkpointing=full"],
         r"trainer.activation_checkpointing=full acts on the model's repeated units .* has none"),
        (["trainer.ac_every=0"], r"trainer.ac_every=0 must be >= 1"),
    ],
)  # fmt: skip
def test_a_lever_that_cannot_apply_is_refused_before_spawn(overrides, message, tmp_path):
    from sharded_exp.launch import preflight

    cfg = compose(tiny(overrides))
    with pytest.raises(ConfigError, match=message):
        preflight.check(cfg, str(tmp_path))


@pytest.mark.slow  # two CUDA plans of five points, whole (each replayed through the allocator and timed)
def test_plan_levers_and_the_cheapest_combination_that_fits(capsys):
    """The planner per lever combination: AC lowers the activations, offload moves the
    states to the host (a GPU plan, by rule); the cheapest combination that fits is named."""
    from sharded_exp.plan import command

    # each point faked once, whole (composed by depth gives the same figures: test_plan_compose.py)
    model = ["model=gpt", "model.d_model=64", "model.n_layers=6", "model.seq_len=128", "trainer.batch_size=4",
             "plan.by_depth=false"]  # fmt: skip

    def plan(budget_gib: float) -> tuple[dict, dict]:
        assert command.main([*model, "plan.format=json", "plan.world_sizes=[2]", "plan.strategies=[ddp,fsdp]",
                             "plan.levers=[none,ac,ac+offload]", f"plan.device_memory_gib={budget_gib}"]) == 0  # fmt: skip
        out = json.loads(capsys.readouterr().out)
        return out, {(r["strategy"], r["levers"]): r for r in out["rows"]}

    out, rows = plan(80.0)
    assert set(rows) == {("ddp", "none"), ("ddp", "ac"), ("fsdp", "none"), ("fsdp", "ac"), ("fsdp", "ac+offload")}
    assert rows["ddp", "ac"]["activations_gib"] < rows["ddp", "none"]["activations_gib"]
    offload = rows["fsdp", "ac+offload"]
    assert offload["params_gib"] == offload["optimizer_gib"] == 0 and offload["host_gib"] > 0
    assert offload["total_gib"] < rows["fsdp", "ac"]["total_gib"] and "host<->device" in offload["cost"]
    # A CUDA plan holds what the device shows (reserved + the CUDA context) against the budget: one between
    # ddp's and the next largest leaves ddp out, keeps fsdp and ddp + AC in, and a strategy costs less than a lever.
    total = {k: r["device_total_gib"] for k, r in rows.items()}
    below = max(total["fsdp", "none"], total["ddp", "ac"])
    assert below < total["ddp", "none"]
    out, rows = plan((below + total["ddp", "none"]) / 2)
    assert not rows["ddp", "none"]["fits"] and rows["fsdp", "none"]["fits"] and rows["ddp", "ac"]["fits"]
    assert [(b["strategy"], b["levers"]) for b in out["cheapest"]] == [("fsdp", "none")]
    assert command.main(["plan.levers=[ac+turbo]"]) == 2
    assert "plan.levers entry 'ac+turbo': turbo is not a lever" in capsys.readouterr().err


def test_checkpointed_units_keep_their_names_and_the_fake_step_counts_model_flops():
    """Checkpointing and compile patch a unit's forward, not the module tree: the state
    dict's names are unchanged (a checkpoint resumes with another setting). The fake step
    counts the model's FLOPs, not the recomputed forward's."""
    from sharded_exp.compose import compose
    from sharded_exp.models import build_model
    from sharded_exp.predict.fake_step import fake_step
    from sharded_exp.train.levers import apply_levers

    cfg = compose(["model=gpt", "trainer.activation_checkpointing=selective", "trainer.compile=true"])
    module = build_model(cfg.model)
    names = list(module.state_dict())
    apply_levers(module, cfg.trainer, compile=False)
    assert list(module.state_dict()) == names
    plain, checkpointed = (fake_step(compose(["model=gpt", *o]), 2, 0, "cpu") for o in ([], AC["full"]))
    assert checkpointed.flops_per_step == plain.flops_per_step
    assert checkpointed.peak_mib < plain.peak_mib


@pytest.mark.slow
@pytest.mark.parametrize("lever", list(AC))
def test_activation_checkpointing_wraps_a_hugging_face_model_the_same_way(lever, shared_runs):
    """BERT's layers (its _no_split_modules) are the units; parity as for our GPT."""
    hf = [*PARITY_MODELS["hf_bert"], *PARITY]
    ref_dir, _ = shared_runs("strategy=ddp", *hf)
    out, result = shared_runs("strategy=ddp", *hf, *AC[lever])
    check_run(result, [])
    assert max_relative_diff(out, ref_dir) == 0.0


def test_levers_are_w_and_b_tags():
    from sharded_exp.config import ActivationCheckpointing
    from sharded_exp.output.loggers import run_tags

    base = {"strategy": {"name": "fsdp", "replicate": 2, "cpu_offload": True}, "precision": {"name": "bf16"},
            "model": {"name": "gpt"}, "trainer": {"world_size": 4, "compile": True,
                                                   "activation_checkpointing": ActivationCheckpointing.selective}}  # fmt: skip
    assert run_tags(base)[4:] == ["ac:selective", "compile", "hsdp:2", "cpu_offload"]
    plain = {**base, "strategy": {"name": "ddp"}, "trainer": {"world_size": 2}}
    assert run_tags(plain) == ["strategy:ddp", "precision:bf16", "model:gpt", "world_size:2"]
