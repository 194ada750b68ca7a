"""sharded_exp.predict.prediction: the model's shapes read from a build, the analytic
prediction (model states, gathered parameters), other ranks' peaks from the faked one's,
and predict_peak's rules around one fake step (here a stub step: gathered parameters,
optimizer temporaries, cuBLAS workspace, gloo's copy, CPU offload, errors, notes)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.config import OptimizerConfig
from sharded_exp.predict import prediction as prediction_module
from sharded_exp.predict.fake_step import FakeStepError, StepEstimate
from sharded_exp.predict.prediction import (
    MIB,
    ModelShapes,
    _element_bytes,
    model_shapes,
    peaks_of_ranks,
    predict,
    predict_peak,
)
from sharded_exp.strategies import STRATEGIES

ADAM = OmegaConf.structured(OptimizerConfig(name="adam"))


class Blocks(nn.Module):
    """Three 4x4 blocks (the units: its longest ModuleList) and a 4 -> 2 head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(scope="module")
def configs(tiny_job):
    """The real config tree (composed once); each strategy's own config group put in."""
    base = tiny_job

    def with_strategy(name: str, **fields):
        cfg = base.copy()
        cfg.strategy = OmegaConf.structured(STRATEGIES.config_class(name)(**fields))
        return cfg

    compiled = base.copy()
    compiled.trainer.compile = True
    return {
        "oss": with_strategy("oss"),
        "fsdp": with_strategy("fsdp"),
        "offload": with_strategy("fsdp", cpu_offload=True),
        "sharded_ddp": with_strategy("sharded_ddp"),
        "compiled": compiled,
    }


# ------------------------------------------------------------------- shapes of a model
def test_model_shapes_reads_units_root_groups_and_frozen_parameters():
    module = Blocks()
    module.head.weight.requires_grad_(False)
    shapes = model_shapes(None, ADAM, module=module)
    assert shapes.blocks == [4 * 4 + 4] * 3
    assert shapes.root == 2 * 4 + 2
    assert shapes.params == 3 * 20 + 10
    # 2-D weights decay, 1-D biases do not; the frozen head weight is in neither group
    assert shapes.groups == [[(4, 4)] * 3, [(4,)] * 3 + [(2,)]]
    assert shapes.frozen == [(2, 4)]
    assert shapes.state_shapes["head.weight"] == (2, 4) and len(shapes.state_shapes) == 8
    assert shapes.element_bytes == 4.0


def test_a_tied_parameter_counts_once():
    module = Blocks()
    module.blocks[1].weight = module.blocks[0].weight  # shared by two blocks
    shapes = model_shapes(None, ADAM, module=module)
    assert sum(len(g) for g in shapes.groups) == 7  # 8 tensors, one of them twice
    assert shapes.params == 70 - 16


def test_element_bytes_are_the_parameters_average_weighted_by_elements():
    module = nn.Module()
    module.a = nn.Parameter(torch.zeros(30, dtype=torch.float32))
    module.b = nn.Parameter(torch.zeros(10, dtype=torch.float64))
    assert _element_bytes(module) == pytest.approx((30 * 4 + 10 * 8) / 40)
    assert _element_bytes(nn.Module()) == 4.0  # no parameters: float32's


# ----------------------------------------------------------------------- predict
SHAPES = ModelShapes(groups=[[(8, 8)], [(8,)]], blocks=[30, 40, 10], root=5, state_shapes={})


@pytest.mark.parametrize(
    "name, precision, gathered_bytes",
    [
        ("fsdp", "32", (5 + 40) * 4),  # resharded after forward: the root and the largest block
        ("fsdp", "bf16", (5 + 40) * 2),  # gathered in the compute dtype
        ("fsdp_grad_op", "16", (5 + 30 + 40 + 10) * 2),  # not resharded: every block stays gathered
        ("ddp", "32", 0),
    ],
)
def test_gathered_parameters_follow_the_strategy_and_the_compute_dtype(name, precision, gathered_bytes):
    out = predict(STRATEGIES.config_class(name)(), ADAM, precision, SHAPES, world_size=4)
    assert out["transient_params_mib"] == pytest.approx(gathered_bytes / MIB)
    assert len(out["model_states_mib"]) == 4


def test_a_float64_model_gathers_in_its_own_dtype_at_precision_32():
    shapes = ModelShapes(groups=[[(8, 8)]], blocks=[30, 40], root=5, state_shapes={}, element_bytes=8.0)
    out = predict(STRATEGIES.config_class("fsdp")(), ADAM, "32", shapes, world_size=2)
    assert out["transient_params_mib"] == pytest.approx((5 + 40) * 8 / MIB)
    assert out["model_states_mib"][0]["params"] == pytest.approx(8 * 4 * 8 / MIB)  # 8 rows / 2 ranks x 8 cols


def test_a_model_without_units_gathers_nothing():
    shapes = ModelShapes(groups=[[(8, 8)]], blocks=[], root=64, state_shapes={})
    assert predict(STRATEGIES.config_class("fsdp")(), ADAM, "32", shapes, 2)["transient_params_mib"] == 0


def test_predict_passes_the_asked_ranks_through():
    out = predict(STRATEGIES.config_class("ddp")(), ADAM, "32", SHAPES, world_size=4, ranks=[3])
    assert len(out["model_states_mib"]) == 1


# ------------------------------------------------------------------ peaks_of_ranks
def test_another_ranks_peak_is_lower_by_its_smaller_states_and_step_temporaries():
    states = [{"params": 4.0, "grads": 4.0, "optimizer": 6.0}, {"params": 4.0, "grads": 4.0, "optimizer": 2.0}]
    phase = (20.0, {"params": 4.0, "grads": 4.0, "optimizer": 6.0, "optimizer_step": 3.0, "activations": 3.0})
    peaks = peaks_of_ranks([phase], states, rank=0)
    # rank 1 holds 1/3 of the optimizer state: 2/3 of the state and of its step's temporaries go
    assert peaks == pytest.approx([20.0, 20.0 - 6.0 * 2 / 3 - 3.0 * 2 / 3])


def test_a_rank_with_a_small_shard_peaks_in_the_other_phase():
    states = [{"params": 4.0, "grads": 4.0, "optimizer": 6.0}, {"params": 4.0, "grads": 4.0, "optimizer": 1.0}]
    step = (18.0, {"params": 4.0, "grads": 4.0, "optimizer": 0.0, "activations": 10.0})
    optimizer = (20.0, {"params": 4.0, "grads": 4.0, "optimizer": 6.0, "optimizer_step": 6.0})
    peaks = peaks_of_ranks([step, optimizer], states, rank=0)
    assert peaks[0] == 20.0
    assert peaks[1] == pytest.approx(18.0)  # optimizer phase: 20 - 5 - 5 = 10 < the step's 18


def test_a_state_the_faked_rank_does_not_hold_is_not_scaled():
    states = [{"params": 4.0, "grads": 0.0, "optimizer": 0.0}, {"params": 2.0, "grads": 0.0, "optimizer": 0.0}]
    peaks = peaks_of_ranks([(10.0, {"params": 4.0, "grads": 1.0})], states, rank=0)
    assert peaks == pytest.approx([10.0, 8.0])


# ------------------------------------------------------------------- predict_peak
STATES = [{"params": 4.0, "grads": 4.0, "optimizer": 6.0}, {"params": 4.0, "grads": 4.0, "optimizer": 2.0}]


def breakdown(**parts) -> dict[str, float]:
    out = {k: 0.0 for k in ("params", "grads", "optimizer", "gathered", "buckets", "activations", "temporaries",
                            "communication", "other")}  # fmt: skip
    return {**out, **parts}


@pytest.fixture
def stub_step(monkeypatch):
    """fake_step replaced: returns the estimate the test sets, records how it was called."""
    calls = []
    box = {}

    def stub(cfg, world_size, rank, device_type, states_of, flops=True, trace=False):
        calls.append({"world_size": world_size, "rank": rank, "device_type": device_type})
        if isinstance(box["est"], BaseException):
            raise box["est"]
        return box["est"]

    monkeypatch.setattr(prediction_module, "fake_step", stub)  # as prediction calls it
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)

    def set_estimate(est):
        box["est"] = est
        return calls

    return set_estimate


def estimate(peak, parts, extra=None, note=""):
    return StepEstimate(0, peak, parts, 1234, "fake step", note=note, seconds=0.5, extra=extra or {})


def test_the_rank_with_the_most_model_states_is_faked(configs, stub_step):
    calls = stub_step(estimate(10.0, breakdown(params=4.0, grads=4.0, optimizer=2.0)))
    prediction = {"model_states_mib": list(reversed(STATES))}
    out = predict_peak(configs["oss"], 2, "cpu", prediction, SHAPES)
    assert calls[0]["rank"] == 1 and out["rank"] == 1 and calls[0]["world_size"] == 2
    assert out["flops_per_step"] == 1234 and out["method"] == "fake step" and out["error"] is None


def test_optimizer_memory_beyond_the_ranks_state_is_the_steps_temporaries(configs, stub_step):
    stub_step(estimate(20.0, breakdown(params=4.0, grads=4.0, optimizer=9.0, activations=3.0)))
    out = predict_peak(configs["oss"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)
    assert out["breakdown_mib"]["optimizer"] == 6.0 and out["breakdown_mib"]["optimizer_step"] == 3.0
    # rank 1: a third of rank 0's optimizer state, and of its step's temporaries
    assert out["per_rank_mib"] == pytest.approx([20.0, 20.0 - 6.0 * 2 / 3 - 3.0 * 2 / 3])
    assert out["rules"] == {} and out["breakdown_mib"]["workspace"] == 0.0 and out["host_mib"] is None
    assert out["kernels"] == "cpu: fake tensors on the CPU device"


def test_parameters_beyond_the_resident_ones_are_gathered(configs, stub_step):
    stub_step(estimate(15.0, breakdown(params=7.0, grads=4.0, optimizer=4.0, gathered=1.0)))
    out = predict_peak(configs["fsdp"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)
    assert out["breakdown_mib"]["params"] == 4.0 and out["breakdown_mib"]["gathered"] == 1.0 + 3.0
    assert out["breakdown_mib"]["optimizer_step"] == 0.0  # below the state: max(0, 4 - 6)


def test_each_phase_is_broken_down_and_the_larger_lowered_peak_is_a_ranks(configs, stub_step):
    phases = {
        "step": (18.0, breakdown(params=4.0, grads=4.0, activations=10.0)),
        "optimizer": (20.0, breakdown(params=4.0, grads=4.0, optimizer=12.0)),
    }
    stub_step(estimate(20.0, phases["optimizer"][1], extra={"phases": phases}))
    states = [STATES[0], {"params": 4.0, "grads": 4.0, "optimizer": 1.0}]
    out = predict_peak(configs["oss"], 2, "cpu", {"model_states_mib": states}, SHAPES)
    assert out["per_rank_mib"] == pytest.approx([20.0, 18.0])
    peak, parts = out["phases_mib"]["optimizer"]
    assert peak == 20.0 and parts["optimizer"] == 6.0 and parts["optimizer_step"] == 6.0
    assert out["phases_mib"]["step"][0] == 18.0


def test_a_cuda_prediction_adds_the_cublas_workspace_everywhere(configs, stub_step):
    calls = stub_step(estimate(10.0, breakdown(params=4.0, grads=4.0, optimizer=2.0)))
    out = predict_peak(configs["oss"], 2, "cuda", {"model_states_mib": STATES}, SHAPES)
    assert calls[0]["device_type"] == "cuda"
    assert out["breakdown_mib"]["workspace"] == 32.0  # torch's default from Hopper on
    assert out["per_rank_mib"][0] == pytest.approx(10.0 + 32.0)
    assert out["phases_mib"]["all"][0] == pytest.approx(42.0)
    assert "workspace" in out["rules"] and "CUDA's kernel choices" in out["kernels"]


def test_gloos_reduce_scatter_copy_is_named_as_a_rule_only_when_one_ran(configs, stub_step):
    parts = breakdown(params=4.0, grads=4.0, optimizer=6.0)
    stub_step(estimate(14.0, parts, extra={"gloo_reduce_scatters": 2}))
    assert (
        "gloo_reduce_scatter" in predict_peak(configs["fsdp"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)["rules"]
    )
    stub_step(estimate(14.0, parts, extra={"gloo_reduce_scatters": 0}))
    assert predict_peak(configs["fsdp"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)["rules"] == {}


def test_cpu_offload_moves_the_resident_states_and_the_step_to_the_host(configs, stub_step):
    phases = {"all": (25.0, breakdown(params=4.0, grads=4.0, optimizer=9.0, gathered=2.0, activations=6.0))}
    stub_step(estimate(25.0, phases["all"][1], extra={"phases": phases}))
    out = predict_peak(configs["offload"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)
    # The host's side comes from the shapes (SHAPES: an 8 x 8 and an 8 in two groups, four rows
    # each a rank): pinned shards 128 + 16 B of parameters and as much of gradients (powers of
    # two already), Adam's state 2 x (128 + 16) + two 4-byte steps = 296 B, and the host step's
    # square root and quotient (8 B an element, counted from Adam's ops, per tensor as an
    # offloaded run builds it) for its largest tensor: 32 elements, 256 B. 840 B a rank.
    assert out["host_mib"] == [840 / 2**20, 840 / 2**20]
    assert out["host_breakdown_mib"] == pytest.approx(
        {"pinned": 288 / 2**20, "tensor_bytes": 288 / 2**20, "optimizer": 296 / 2**20, "step": 256 / 2**20}
    )
    assert "pinned_host" in out["rules"]
    foreach = configs["offload"].copy()
    foreach.optimizer.foreach = True  # the square root (4 B) for a whole group at once: the largest, 32 elements
    out = predict_peak(foreach, 2, "cpu", {"model_states_mib": STATES}, SHAPES)
    assert out["host_breakdown_mib"]["step"] == pytest.approx(4 * 32 / 2**20)
    # rank 0's device keeps what is gathered and computed: 25 - (4 + 4 + 6 + 3)
    assert out["per_rank_mib"][0] == pytest.approx(8.0)
    for key in ("params", "grads", "optimizer", "optimizer_step"):
        assert out["breakdown_mib"][key] == 0.0 and out["phases_mib"]["all"][1][key] == 0.0
    assert out["breakdown_mib"]["gathered"] == 2.0 and out["phases_mib"]["all"][0] == pytest.approx(8.0)
    assert "cpu_offload" in out["rules"]


def test_the_build_peak_is_passed_through_or_null(configs, stub_step):
    build = {"peak_mib": 3.5, "breakdown_mib": {"params": 3.0}}
    stub_step(estimate(10.0, breakdown(params=4.0), extra={"build": build}))
    out = predict_peak(configs["oss"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)
    assert out["build_peak_mib"] == 3.5 and out["build_breakdown_mib"] == {"params": 3.0}
    stub_step(estimate(10.0, breakdown(params=4.0)))
    assert predict_peak(configs["oss"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)["build_peak_mib"] is None


def test_a_failed_step_inside_is_named_by_its_part(configs, stub_step):
    stub_step(FakeStepError("the model cannot be built under FakeTensorMode", ValueError("bad\nsecond line")))
    out = predict_peak(configs["oss"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)
    assert out == {
        "per_rank_mib": None,
        "error": "the model cannot be built under FakeTensorMode: ValueError: bad second line",
    }


def test_a_failure_outside_the_step_is_the_predictions_own(configs, stub_step):
    stub_step(KeyError("phases"))
    out = predict_peak(configs["oss"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)
    assert out["per_rank_mib"] is None and out["error"] == "the fake step failed: KeyError: 'phases'"


def test_notes_join_the_steps_the_compile_and_the_zero_grad_rule(configs, stub_step):
    stub_step(estimate(10.0, breakdown(params=4.0), note="the step's note"))
    assert predict_peak(configs["oss"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)["note"] == "the step's note"
    stub_step(estimate(10.0, breakdown(params=4.0)))
    compiled = predict_peak(configs["compiled"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)["note"]
    assert compiled.startswith("trainer.compile: the units are faked eager")
    zeroed = predict_peak(configs["sharded_ddp"], 2, "cpu", {"model_states_mib": STATES}, SHAPES)["note"]
    assert zeroed.startswith("trainer.zero_grad=free not honoured, faked as zeros: sharded_ddp zeroes")


def test_cpu_offload_moves_the_ranks_shards_to_the_host_and_keeps_what_is_beyond_them(monkeypatch):
    """A rank's own shards (4 MiB of parameters, 4 of gradients, 8 of optimizer state) are in
    host memory; a unit's unsharded gradient before its reduce-scatter (the 6 MiB tracked
    beyond the rank's 4) is on the device and stays in ``grads``: the parts still add up to
    the peak, in the breakdown and in every phase."""
    monkeypatch.setattr(prediction_module, "offload_host", lambda *a: ([1.0], {}))
    mine = {"params": 4.0, "grads": 4.0, "optimizer": 8.0}
    parts = {"params": 4.0, "grads": 10.0, "optimizer": 8.0, "optimizer_step": 2.0, "gathered": 16.0,
             "activations": 5.0}  # fmt: skip
    phases = {
        "step": (45.0, dict(parts)),
        "optimizer": (20.0, {**parts, "grads": 4.0, "gathered": 0.0, "activations": 2.0}),
    }
    per_rank, out, phases, host = prediction_module._offloaded(None, None, 2, mine, parts, [45.0, 44.0], phases, {})
    assert out == {"params": 0.0, "grads": 6.0, "optimizer": 0.0, "optimizer_step": 0.0, "gathered": 16.0,
                   "activations": 5.0}  # fmt: skip
    assert per_rank == [27.0, 26.0] and sum(out.values()) == per_rank[0]
    for peak, p in phases.values():
        assert sum(p.values()) == peak
    assert phases["optimizer"][1]["grads"] == 0.0 and host == ([1.0], {})
