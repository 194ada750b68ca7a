"""How a model comes into being, and what the build and the training hold at scale.

No rank builds the whole model: parameters start on the meta device and are initialised
unit by unit, each rank keeping its shards of one whole unit at a time (sharded_exp.models.materialise).
The predictions follow what a run holds: a prediction per rank that does not rise with
world size where every state is sharded, depth-drawn and whole-model fakes that agree, the
strategies' communication buckets as a category of their own, and fairscale's reduce
callbacks that free the gradients a rank does not own in the fake step too.
"""

from __future__ import annotations

import math

import pytest
import torch

from sharded_exp.compose import compose
from tests.helpers.jobs import launch_job, tiny
from tests.helpers.overrides import DEEP

MIB, GIB = 2**20, 2**30
TWO_STEPS = ["trainer.steps=3", "trainer.warmup_steps=2", "trainer.eval_batches=0"]
SHALLOW = [*DEEP, "model.n_layers=2"]
"""DEEP's blocks, two of them: where a rule holds block by block, a whole-model fake step of
two blocks shows it at a quarter of the cost of eight."""


def plan_rows(*overrides: str, world_sizes, strategies, device: str = "cpu") -> list[dict]:
    from sharded_exp.plan import points as plan

    cfg = compose([*overrides, f"plan.strategies=[{','.join(strategies)}]", f"plan.device={device}"], "plan")
    return plan.plan_rows(cfg, list(world_sizes), device)


# ------------------------------------------------------------------ initial weights
def test_initial_weights_are_the_models_own_rule_unit_by_unit():
    """A meta-device skeleton initialised unit by unit draws each parameter as its model
    does (torch's reset_parameters; Hugging Face's _init_weights, rotary tables included):
    the same statistics as a whole build, the same values on a second build, and tied
    weights stay tied."""
    from sharded_exp.models import build_model, materialise

    for model in ("model=gpt", "model=hf_gpt2", "model=hf_llama", "model=hf_bert"):
        cfg = compose([model], "config")
        whole = build_model(cfg.model)
        made = []
        for _ in range(2):
            with materialise.parameters_on_meta():
                module = build_model(cfg.model)
            assert all(p.is_meta for p in module.parameters())
            materialise.materialise(module, torch.device("cpu"))
            materialise.initialise_by_unit(module, seed=3, host=torch.device("cpu"))
            made.append(module)
        first, again = (dict(m.named_parameters()) for m in made)
        assert len(first) == len(dict(whole.named_parameters())), model  # ties kept (GPT-2's LM head)
        for name, ref in whole.named_parameters():
            assert torch.equal(first[name], again[name]), (model, name)
            if ref.numel() >= 4096:  # a distribution's spread, not the draw
                assert first[name].std().item() == pytest.approx(ref.std().item(), rel=0.05), (model, name)
        for (name, ref), (_, mine) in zip(whole.named_buffers(), made[0].named_buffers()):
            assert torch.equal(ref, mine), (model, name)


@pytest.mark.parametrize("model", ["model=hf_bert", "model=gpt"])
def test_every_strategy_starts_from_ddps_weights(model, gloo_group):
    """The unit-by-unit draw is the same whether the strategy shards (FSDP renames its
    units' classes: the units are found before it wraps) or not."""
    from torch.distributed.tensor import DTensor

    from sharded_exp.train.build import build_run

    def weights(strategy: str) -> dict[str, torch.Tensor]:
        run = build_run(compose([model, f"strategy={strategy}"], "config"), torch.device("cpu"), with_task=False)
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in run.module.named_parameters()
        }

    ddp, fsdp = weights("ddp"), weights("fsdp")
    assert ddp.keys() == fsdp.keys()
    for name in ddp:
        assert torch.equal(ddp[name], fsdp[name]), name


def test_a_parameter_no_initialisation_covers_is_named():
    from torch import nn

    from sharded_exp.errors import ConfigError
    from sharded_exp.models.materialise import check_initialisable

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

    with pytest.raises(ConfigError, match=r"model parameter scale \(Scaled\) has no reset_parameters"):
        check_initialisable(Scaled())


def test_a_registered_model_with_a_parameter_of_its_own_is_built_whole(gloo_group, monkeypatch):
    """A model whose constructor sets a parameter no reset_parameters covers keeps the
    constructor's values: it is built whole (the ``whole`` rule), not refused."""
    from torch import nn

    from sharded_exp.models import materialise
    from sharded_exp.train import build

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(64, 10)
            self.scale = nn.Parameter(torch.full((10,), 0.5))

        def forward(self, inputs, targets=None):
            return self.body(inputs) * self.scale

    monkeypatch.setattr(materialise, "build_model", lambda cfg, freeze=(), weights=False: Scaled())
    run = build.build_run(compose([], "config"), torch.device("cpu"), with_task=False)
    assert run.build == "whole"
    assert torch.equal(run.module.scale.detach(), torch.full((10,), 0.5))


# --------------------------------------------------------------- the build's own peak
def test_sharded_build_holds_its_shards_and_one_unit(tmp_path):
    """2 ranks of fsdp: each rank's measured build peak is its shard of every parameter
    plus one whole unit (the largest), far below the whole model; the fake step predicts
    it; and the training peak starts after it."""
    from sharded_exp.models import units
    from sharded_exp.predict.prediction import meta_model

    result = launch_job(["strategy=fsdp", *DEEP, *TWO_STEPS], tmp_path)
    assert result["status"] == "ok", result["error"]
    cfg = compose(DEEP, "config")
    model = meta_model(cfg.model)
    unit_mib = max(sum(p.numel() for p in u.parameters()) for u in units(model)) * 4 / MIB
    root_mib = (sum(p.numel() for p in model.parameters()) * 4 / MIB) - sum(
        sum(p.numel() for p in u.parameters()) * 4 / MIB for u in units(model)
    )
    whole_mib = result["params"] * 4 / MIB
    mem = result["memory"]
    for entry in mem["per_rank"]:
        shard = entry["model_states_mib"]["params"]
        expected = shard + max(unit_mib, root_mib)
        assert entry["build_peak_mib"] == pytest.approx(expected, rel=0.02), (
            entry["rank"],
            entry["build_breakdown_mib"],
        )
        assert entry["build_peak_mib"] < 0.75 * whole_mib
    assert mem["predicted_build_peak_mib"] == pytest.approx(mem["build_peak_mib_max"], rel=0.02)
    assert mem["peak_allocated_mib_max"] > mem["build_peak_mib_max"]


@pytest.mark.slow
def test_fsdp_at_8_ranks_trains_under_a_budget_the_whole_model_exceeds(tmp_path):
    """8 ranks of fsdp, a 16-block model whose fp32 parameters alone are over the budget:
    the build and the training fit (the budget covers the build), and the result equals
    DDP's at the same settings without the budget."""
    from sharded_exp.predict.prediction import model_shapes

    deep = [*DEEP, "model.d_model=256", "model.n_layers=16", "trainer.world_size=8", "trainer.steps=4"]
    cfg = compose(tiny(deep))  # the model counted on the meta device, as a job counts it (no job of its own)
    params = model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze).params
    whole_mib = params * 4 / MIB
    budget = 0.8 * whole_mib
    sharded = launch_job(["strategy=fsdp", *deep, f"trainer.memory_limit_mib={budget}"], tmp_path / "fsdp")
    assert sharded["status"] == "ok", sharded["error"]
    assert sharded["params"] == params  # the model the budget was set from
    mem = sharded["memory"]
    assert mem["build_peak_mib_max"] < budget and mem["peak_allocated_mib_max"] < budget < whole_mib
    reference = launch_job(["strategy=ddp", *deep], tmp_path / "ddp")
    assert reference["status"] == "ok", reference["error"]
    assert sharded["param_digest"]["l2"] == pytest.approx(reference["param_digest"]["l2"], rel=1e-6)
    assert sharded["param_digest"]["sum"] == pytest.approx(reference["param_digest"]["sum"], rel=1e-6, abs=1e-6)
    assert sharded["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-5)


def test_the_budget_covers_the_build(tmp_path):
    """A budget below one rank's shards plus one unit: out of memory while building,
    with the breakdown of that moment."""
    result = launch_job(["strategy=fsdp", *DEEP, *TWO_STEPS, "trainer.memory_limit_mib=0.5"], tmp_path)
    assert result["status"] == "oom", result.get("error")
    assert "while the model was built" in result["error"]
    assert "building the model" in result["memory"]["oom_breakdown"]["phase"]


# ---------------------------------------------------------------- predictions at scale
SHARDED = [("fsdp", []), ("fsdp_grad_op", []), ("hsdp", ["strategy=fsdp", "strategy.replicate=2"]), ("zero1", [])]


@pytest.mark.parametrize(
    "label, extra",
    [pytest.param(s, e, id=s, marks=() if s == "fsdp" else pytest.mark.slow) for s, e in SHARDED],
)  # fsdp in the default tier, the rest with the slow one
def test_predicted_peak_per_rank_does_not_rise_with_world_size(label, extra):
    """At a fixed per-rank batch, where every state shards (or the optimizer's alone), one
    more rank never costs a rank more memory (1 to 64 ranks; HSDP from 2)."""
    name = "fsdp" if label == "hsdp" else label
    sizes = [2, 4, 8, 16, 32, 64] if label == "hsdp" else [1, 2, 4, 8, 16, 32, 64]
    if label == "fsdp":  # the default tier's case: the ends and the middle (every size: the slow tier)
        sizes = [1, 8, 64]
    rows = plan_rows(
        *(SHALLOW if label == "fsdp" else DEEP), *extra, "plan.by_depth=false", world_sizes=sizes, strategies=[name]
    )
    peaks = [r["total_gib"] for r in rows]
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(peaks, peaks[1:])), list(zip(sizes, peaks))
    if label in ("fsdp", "hsdp"):  # resharding after forward: one unit (+ the root) gathered, never the model
        assert all(r["gathered_gib"] * GIB / MIB < 2 for r in rows)


@pytest.mark.slow
def test_fsdp_predicted_peak_per_rank_does_not_rise_at_every_size():
    rows = plan_rows(*DEEP, "plan.by_depth=false", world_sizes=[1, 2, 4, 8, 16, 32, 64], strategies=["fsdp"])
    peaks = [r["total_gib"] for r in rows]
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(peaks, peaks[1:])), peaks


# ------------------------------------------------------------ buckets and fairscale
def test_communication_buckets_are_their_own_category():
    """DDP keeps one all-reduce bucket place per trainable element beside the gradients;
    fairscale's ShardedDDP keeps its reduce buckets, which hold the bucketed gradients;
    FSDP none. The fake step files them as buckets, not as activations, and raw-count
    plans count them as model plans do."""
    rows = {
        r["strategy"]: r
        for r in plan_rows(*SHALLOW, "plan.by_depth=false", world_sizes=[4], strategies=["ddp", "sharded_ddp", "fsdp"])
    }
    params_gib = rows["ddp"]["params_gib"]
    assert rows["ddp"]["buckets_gib"] == pytest.approx(params_gib, rel=1e-6)
    assert rows["ddp"]["activations_gib"] < 0.25 * params_gib
    # one reduce bucket per destination rank, all made at once before each shrinks to its fill
    assert 0 < rows["sharded_ddp"]["buckets_gib"] <= (4 + 1) * params_gib
    assert rows["fsdp"]["buckets_gib"] == 0
    raw = {
        r["strategy"]: r
        for r in plan_rows("plan.params=1e9", world_sizes=[8], strategies=["ddp", "sharded_ddp", "fsdp"])
    }
    assert raw["ddp"]["buckets_gib"] == pytest.approx(raw["ddp"]["params_gib"], rel=1e-6)
    assert raw["fsdp"]["buckets_gib"] == 0


def test_sharded_ddp_fake_step_frees_the_gradients_a_rank_does_not_own():
    """fairscale frees a non-owned gradient when its reduce completes: the fake process
    group's work completes, so the gradients at the peak are the rank's own (the analytic
    count), not every gradient."""
    from sharded_exp.predict.prediction import model_shapes, predict

    overrides = [*DEEP, "model.d_model=256", "strategy=sharded_ddp", "strategy.reduce_buffer_size=0"]  # no buckets
    cfg = compose(overrides, "config")
    shapes = model_shapes(cfg.model, cfg.optimizer)
    analytic = predict(cfg.strategy, cfg.optimizer, "32", shapes, 8)["model_states_mib"]
    (row,) = plan_rows(*overrides, "plan.by_depth=false", world_sizes=[8], strategies=["sharded_ddp"])
    own = max(p["grads"] for p in analytic) * MIB / GIB
    everything = shapes.params * 4 / GIB
    assert row["grads_gib"] <= own * 1.05 + 1e-4 < 0.5 * everything


@pytest.mark.slow
def test_gpt_7b_fsdp_plan_falls_with_world_size_and_never_holds_the_model():
    """The planner's own check at scale (CUDA kernels, bf16, 1 sample): 7B GPT under fsdp
    from 8 to 64 ranks, drawn by depth; nothing gathered beyond one unit and the root."""
    rows = plan_rows("model=gpt_7b", "trainer.batch_size=1", "precision=bf16", world_sizes=[8, 16, 64],
                     strategies=["fsdp"], device="cuda")  # fmt: skip
    peaks = [r["total_gib"] for r in rows]
    assert peaks[0] > peaks[1] > peaks[2]
    assert all(r["gathered_gib"] < 2 for r in rows)
    assert math.isclose(rows[-1]["params_gib"] * 64, rows[0]["params_gib"] * 8, rel_tol=1e-3)


# -------------------------------------------------- every rank, against a gloo run
BUCKETS = {"ddp": ["strategy.bucket_cap_mb=0.5"], "oss": ["strategy.bucket_cap_mb=0.5"],
           "zero1": ["strategy.bucket_cap_mb=0.5"], "sharded_ddp": ["strategy.reduce_buffer_size=65536"],
           "fsdp": [], "fsdp_grad_op": []}  # fmt: skip
"""Several buckets each (a 0.8 M-parameter model: about six DDP buckets of 0.5 MB)."""
BUCKETED = ["model=gpt", "model.d_model=128", "model.n_heads=4", "model.n_layers=4", "model.seq_len=16",
            "model.vocab_size=64", "trainer.batch_size=4", *TWO_STEPS]  # fmt: skip


def _every_rank_within_5_percent(strategy: str, world_size: int, tmp_path) -> None:
    overrides = [f"strategy={strategy}", *BUCKETS[strategy], f"trainer.world_size={world_size}", *BUCKETED]
    result = launch_job(overrides, tmp_path)
    assert result["status"] == "ok", result["error"]
    for entry in result["memory"]["per_rank"]:
        predicted, measured = entry["predicted_peak_mib"], entry["peak_allocated_mib"]
        assert abs(predicted - measured) <= 0.05 * measured, (entry["rank"], predicted, measured)


def test_sharded_ddp_every_rank_within_5_percent_at_3_ranks(tmp_path):
    _every_rank_within_5_percent("sharded_ddp", 3, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", list(BUCKETS))
def test_every_rank_within_5_percent_of_a_gloo_run(strategy, world_size, tmp_path):
    _every_rank_within_5_percent(strategy, world_size, tmp_path)


# ------------------------------------------------------ tied weights on the meta device
def test_a_meta_built_fake_model_keeps_its_tied_weights_tied():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sharded_exp.models.materialise import _tied_to_empty
    from tests.helpers.user_models import build_tied_double

    with torch.device("meta"):
        module = build_tied_double(8, 3)
    with FakeTensorMode(allow_non_fake_inputs=True):  # as the fake step's mode
        module = _tied_to_empty(module, torch.device("cpu"))
    assert module.extra.weight is module.layers[1].weight and module.extra.weight.dtype == torch.float64
    assert len(list(module.named_parameters(remove_duplicate=False))) == 8 and len(list(module.parameters())) == 7
