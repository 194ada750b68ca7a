"""sharded_exp/plan/points.py: the planned points (strategies x levers x world sizes).

A raw parameter count's ideally divisible model and its rows (analytic: bytes per
parameter times the count), the extrapolation beyond 1,024 ranks, which models are
composed by depth, a model's row from a given peak, the cheapest point that fits, the
search for the largest batch or depth (its fake steps replaced by a known line), the
number of worker processes and the order of the rows. No fake step runs here.
"""

from __future__ import annotations

import io
import math

import pytest
from omegaconf import OmegaConf

from sharded_exp.plan import points
from sharded_exp.plan.progress import Progress

GIB, MIB = 2**30, 2**20
N = 2**27
"""A raw count that splits evenly into 32 units of up to 1,024 equal pieces (0.5 GiB in fp32)."""


@pytest.fixture
def raw_cfg(plan_cfg):
    """A raw count of N parameters, fp32 Adam, 32 units, a 1 GiB device."""
    c = plan_cfg.copy()
    c.plan.params, c.plan.units, c.plan.device_memory_gib = float(N), 32, 1.0
    return c


# ----------------------------------------------------------------- names, levers, costs
def test_every_registered_strategy_is_planned_unless_some_are_named(plan_cfg):
    from sharded_exp.strategies import STRATEGIES

    assert points.strategy_names(plan_cfg) == STRATEGIES.names()
    c = plan_cfg.copy()
    c.plan.strategies = ["fsdp", "ddp"]
    assert points.strategy_names(c) == ["fsdp", "ddp"]


def test_strategies_cost_more_the_more_they_shard():
    cost = points.strategy_cost
    assert cost("ddp") < cost("zero1") == cost("oss") < cost("sharded_ddp") < cost("fsdp_grad_op") < cost("fsdp")
    assert cost("not_a_strategy") == 99


def test_lever_combinations_are_names_joined_with_plus():
    assert points.lever_names("none") == []
    assert points.lever_names("ac") == ["ac"]
    assert points.lever_names("ac_selective+offload") == ["ac_selective", "offload"]


def test_offload_applies_to_the_strategies_that_shard_parameters_alone():
    assert points.applies("fsdp", "offload") and points.applies("fsdp_grad_op", "ac+offload")
    assert not points.applies("ddp", "offload") and not points.applies("zero1", "ac+offload")
    assert points.applies("ddp", "ac") and points.applies("ddp", "none")


def test_a_strategy_planned_takes_its_defaults_but_the_configured_one_keeps_its_settings(plan_cfg):
    c = plan_cfg.copy()
    c.strategy = points.STRATEGIES.config_class("fsdp")(replicate=2)
    assert points.with_strategy(c, "fsdp").strategy.replicate == 2  # HSDP stays HSDP
    ddp = points.with_strategy(c, "ddp")
    assert ddp.strategy.name == "ddp" and "replicate" not in ddp.strategy
    grad_op = points.with_strategy(c, "fsdp_grad_op")
    assert grad_op.strategy.replicate == 1 and grad_op.strategy.reshard_after_forward is False
    assert c.strategy.name == "fsdp"  # the caller's config is untouched


def test_levers_set_what_they_name(plan_cfg):
    c = points.with_strategy(plan_cfg, "fsdp", "ac+offload")
    assert c.trainer.activation_checkpointing == "full" and c.strategy.cpu_offload is True
    c = points.with_strategy(plan_cfg, "ddp", "ac_selective")
    assert c.trainer.activation_checkpointing == "selective"
    assert points.with_strategy(plan_cfg, "fsdp").strategy.cpu_offload is False
    assert plan_cfg.trainer.activation_checkpointing != "full"


def test_the_points_are_strategies_by_lever_combinations_that_apply(plan_cfg):
    c = plan_cfg.copy()
    c.plan.strategies, c.plan.levers = ["ddp", "fsdp"], ["none", "offload", "ac"]
    assert points.lever_combos(c) == ["none", "offload", "ac"]
    assert points.points(c) == [("ddp", "none"), ("ddp", "ac"), ("fsdp", "none"), ("fsdp", "offload"), ("fsdp", "ac")]
    c.plan.params = 1e9  # a raw count has no levers
    assert points.points(c) == [("ddp", "none"), ("fsdp", "none")]
    c.plan.levers = []
    assert points.lever_combos(c) == ["none"]


# ------------------------------------------------------------------------- raw counts
def test_a_raw_count_is_exactly_its_elements_in_blocks_and_one_piece_per_rank():
    shapes = points.raw_shapes(1000, 4, 3)
    assert shapes.blocks == [250] * 4 and shapes.root == 0 and shapes.params == 1000
    assert shapes.groups == [[(84,), (83,), (83,)] * 4]  # 250 in 3 pieces, the larger first


def test_a_raw_count_sharded_by_rows_is_one_tensor_per_unit_that_the_strategy_shards():
    shapes = points.raw_shapes(1001, 4, 3, row_sharded=True)
    assert shapes.groups == [[(251,), (250,), (250,), (250,)]]
    assert shapes.blocks == [251, 250, 250, 250] and shapes.params == 1001


@pytest.mark.parametrize("params, units, world_size", [(1, 32, 64), (12345, 1000, 2048), (7, 3, 5), (10**6, 32, 1)])
def test_a_raw_count_holds_no_padding_whatever_the_units_and_ranks(params, units, world_size):
    for row_sharded in (False, True):
        shapes = points.raw_shapes(params, units, world_size, row_sharded)
        assert shapes.params == params
        assert sum(math.prod(s) for g in shapes.groups for s in g) == params
        assert all(math.prod(s) > 0 for g in shapes.groups for s in g)  # no empty tensor


def test_a_one_parameter_model_holds_one_parameter_per_rank_at_64_ranks(raw_cfg):
    c = raw_cfg.copy()
    c.plan.params = 1
    r = points.raw_row(c, "ddp", 64)
    assert r["params_gib"] * GIB == pytest.approx(4.0)  # one float32 element, not 2,048


def test_a_raw_ddp_row_holds_every_state_whole_and_a_bucket_per_gradient(raw_cfg):
    r = points.raw_row(raw_cfg, "ddp", 4)
    half = N * 4 / GIB  # fp32
    assert r["params_gib"] == pytest.approx(half) and r["grads_gib"] == pytest.approx(half)
    assert r["optimizer_gib"] == pytest.approx(2 * half, rel=1e-5)  # Adam's two moments
    assert r["buckets_gib"] == pytest.approx(half)  # all-reduce buckets beside the gradients
    assert r["gathered_gib"] == 0.0 and r["activations_gib"] is None
    assert r["total_gib"] == pytest.approx(5 * half, rel=1e-5) and r["mean_gib"] == r["total_gib"]
    assert r["fits"] is False  # 2.5 GiB on a 1 GiB device
    assert r["method"] == "raw parameter count (analytic, no activations)" and r["note"] == ""


def test_a_raw_zero1_row_shards_the_optimizer_state_alone(raw_cfg):
    r = points.raw_row(raw_cfg, "zero1", 4)
    half = N * 4 / GIB
    assert r["params_gib"] == pytest.approx(half) and r["grads_gib"] == pytest.approx(half)
    assert r["optimizer_gib"] == pytest.approx(2 * half / 4, rel=1e-5)


def test_a_raw_fsdp_row_shards_everything_and_gathers_one_unit(raw_cfg):
    r = points.raw_row(raw_cfg, "fsdp", 4)
    half = N * 4 / GIB
    assert r["params_gib"] == pytest.approx(half / 4) and r["grads_gib"] == pytest.approx(half / 4)
    assert r["optimizer_gib"] == pytest.approx(2 * half / 4, rel=1e-5)
    assert r["gathered_gib"] == pytest.approx(half / 32)  # one of 32 units, whole
    assert r["buckets_gib"] == 0.0
    assert r["fits"] is True


def test_raw_rows_up_to_1024_ranks_are_exact_and_beyond_drawn_from_exact_plans(raw_cfg):
    assert points.raw_row(raw_cfg, "fsdp", points.EXACT_UP_TO)["note"] == ""
    r = points.raw_row(raw_cfg, "fsdp", 4096)
    assert r["note"] == "from the exact plans at 256, 512 and 1024 ranks (every figure is a + b/world_size)"
    half = N * 4 / GIB
    assert r["params_gib"] == pytest.approx(half / 4096, rel=1e-3)
    assert r["optimizer_gib"] == pytest.approx(2 * half / 4096, rel=1e-3)
    assert r["gathered_gib"] == pytest.approx(half / 32, rel=1e-6)


def test_the_line_beyond_1024_ranks_is_a_plus_b_over_the_world_size(raw_cfg, monkeypatch):
    seen = []

    def exact(cfg, name, w):
        seen.append(w)
        return {"x": 3.0 + 512.0 / w, "y": 0.0 + 0.0 / w, "z": 1.0 - 2048.0 / w}

    monkeypatch.setattr(points, "_raw_parts", exact)
    line, note = points._raw_parts_at_scale(raw_cfg, "ddp", 4096)
    assert seen == [256, 512, 1024]
    assert line["x"] == pytest.approx(3.0 + 512.0 / 4096) and line["y"] == 0.0
    assert line["z"] == pytest.approx(1.0 - 2048.0 / 4096)
    assert "256, 512 and 1024" in note
    line, _ = points._raw_parts_at_scale(raw_cfg, "ddp", 1025)
    assert line["x"] == pytest.approx(3.0 + 512.0 / 1025)


def test_a_figure_off_the_line_is_planned_exactly_instead(raw_cfg, monkeypatch):
    seen = []

    def exact(cfg, name, w):
        seen.append(w)
        return {"x": 1.0 / w**2}

    monkeypatch.setattr(points, "_raw_parts", exact)
    line, note = points._raw_parts_at_scale(raw_cfg, "ddp", 4096)
    assert seen == [256, 512, 1024, 4096] and note == ""
    assert line["x"] == pytest.approx(1.0 / 4096**2)


def test_a_figure_drawn_below_zero_is_zero(raw_cfg, monkeypatch):
    monkeypatch.setattr(points, "_raw_parts", lambda cfg, name, w: {"x": -1.0 + 512.0 / w})
    line, _ = points._raw_parts_at_scale(raw_cfg, "ddp", 4096)
    assert line["x"] == 0.0


def test_a_row_totals_the_parts_that_hold_something(raw_cfg):
    r = points._row(raw_cfg, "ddp", 2, {"params": 0.5, "activations": None, "grads": 0.25}, "m", "n")
    assert r["total_gib"] == 0.75 and r["mean_gib"] == 0.75 and r["fits"] is True
    assert r["params_gib"] == 0.5 and r["activations_gib"] is None
    assert (r["strategy"], r["world_size"], r["method"], r["note"]) == ("ddp", 2, "m", "n")
    assert points._row(raw_cfg, "ddp", 2, {"params": 1.0}, "m", "")["fits"] is True  # at the budget: fits
    assert points._row(raw_cfg, "ddp", 2, {"params": 1.001}, "m", "")["fits"] is False


# --------------------------------------------------------------------------- by depth
def _model(cfg, *overrides):
    c = cfg.copy()
    for o in overrides:
        key, value = o.split("=")
        OmegaConf.update(c, key, int(value) if value.isdigit() else value == "true")
    return c


def test_a_model_deeper_than_three_fakes_is_composed_by_depth(gpt_cfg):
    assert points.depth_of(gpt_cfg, "ddp") == ("n_layers", 6)
    assert points.depth_of(_model(gpt_cfg, "model.n_layers=4"), "ddp") == ("n_layers", 4)
    assert points.depth_of(_model(gpt_cfg, "model.n_layers=3"), "ddp") is None  # the three fakes are the model
    assert points.depth_of(gpt_cfg, "fsdp") == ("n_layers", 6)  # fsdp fakes 3, 4, 5 blocks
    assert points.depth_of(_model(gpt_cfg, "model.n_layers=5"), "fsdp") is None


def test_a_model_is_faked_whole_when_asked_or_without_blocks(gpt_cfg, plan_cfg):
    assert points.depth_of(_model(gpt_cfg, "plan.by_depth=false"), "ddp") is None
    frozen = gpt_cfg.copy()
    frozen.trainer.freeze = ["blocks_.5.*"]  # a block the shallow fakes have not got
    assert points.depth_of(frozen, "ddp") is None
    assert points.depth_of(plan_cfg, "ddp") is None  # the MLP has no n_layers


def test_a_hugging_face_models_depth_is_its_configs():
    from sharded_exp.compose import compose

    cfg = compose(["model=hf_llama", "model.config.num_hidden_layers=7"], config_name="plan")
    assert points._layer_key(cfg.model) == "config.num_hidden_layers"
    assert points.depth_of(cfg, "ddp") == ("config.num_hidden_layers", 7)


def test_composed_peaks_draw_the_strategy_with_its_levers(gpt_cfg, monkeypatch):
    seen = []
    monkeypatch.setattr(points, "peaks_by_depth", lambda c, ws, dev, key, layers: seen.append(
        (c.strategy.name, c.strategy.cpu_offload, c.trainer.activation_checkpointing, ws, dev, key, layers))
        or {w: {"w": w} for w in ws})  # fmt: skip
    out = points.composed_peaks(gpt_cfg, "fsdp", (2, 8), "cuda", "ac+offload")
    assert seen == [("fsdp", True, "full", [2, 8], "cuda", "n_layers", 6)]
    assert out == {2: {"w": 2}, 8: {"w": 8}}
    # a shallow model: every point faked whole, nothing drawn
    assert points.composed_peaks(_model(gpt_cfg, "model.n_layers=2"), "ddp", [2, 8], "cpu") == {2: None, 8: None}
    assert len(seen) == 1


# ------------------------------------------------------------------- a model's row
def _peak(per_rank, breakdown, phases=None):
    return {"per_rank_mib": per_rank, "rank": 0, "breakdown_mib": breakdown, "method": "made up",
            "note": "a note", "seconds": 1.5, "phases_mib": phases}  # fmt: skip


def test_a_models_row_is_its_largest_ranks_peak_and_the_mean_over_ranks(raw_cfg):
    shapes = points.raw_shapes(N, 32, 2)
    c = raw_cfg.copy()
    c.plan.params = None
    phases = {"step": (2048.0, {}), "optimizer": (1024.0, {})}
    r = points.model_row(c, "ddp", 2, shapes, "cpu", peak=_peak([2048.0, 1024.0], {"params": 512.0}, phases))
    assert r["total_gib"] == 2.0 and r["mean_gib"] == 1.5
    assert r["fits"] is False  # 2 GiB on a 1 GiB device
    assert r["params_gib"] == 0.5 and r["seconds"] == 1.5
    assert r["phases_gib"] == {"step": 2.0, "optimizer": 1.0}
    assert r["model_states_gib"] == pytest.approx(4 * N * 4 / GIB, rel=1e-5)  # params, grads, two moments
    assert (r["method"], r["note"], r["levers"], r["cost"]) == ("made up", "a note", "none", "")
    assert "host_gib" not in r


def test_a_row_offloaded_holds_the_ranks_states_in_host_memory(raw_cfg):
    shapes = points.raw_shapes(N, 32, 2, row_sharded=True)
    c = raw_cfg.copy()
    c.plan.params = None
    r = points.model_row(c, "fsdp", 2, shapes, "cpu", "offload", peak=_peak([512.0, 512.0], {"params": 1.0}))
    states = 4 * N * 4 / 2 / GIB  # every state halved
    # Each unit's shard, 2**21 elements (8 MiB), is already a power of two: pinned as it is.
    # The host's Adam step (per tensor, as an offloaded run builds it) writes a square root and a
    # quotient, 8 bytes an element, of its largest shard (2**21 elements): 16 MiB on top.
    assert r["host_gib"] == pytest.approx(states + 16 * MIB / GIB, rel=1e-5)
    assert r["model_states_gib"] == pytest.approx(states)
    assert r["host_node_gib"] == pytest.approx(2 * r["host_gib"])  # both ranks on one node
    assert r["host_memory_gib"] == 2048.0 and r["host_memory_basis"] == "h100_sxm's server"
    assert r["fits"] is True and r["phases_gib"] == {}
    tight = c.copy()
    tight.plan.host_memory_gib = 2.0  # the node holds 2.03 GiB: the device fits, the host does not
    r = points.model_row(tight, "fsdp", 2, shapes, "cpu", "offload", peak=_peak([512.0, 512.0], {"params": 1.0}))
    assert r["fits"] is False and r["host_memory_basis"] == "plan.host_memory_gib"
    said = "offload: the node's ranks pin and hold 2.03 GiB of host memory, more than its 2 GiB (plan.host_memory_gib)"
    assert said in r["note"]
    moved = 3 * N * 4 / 2 / GIB  # this rank's parameters in before each gather (forward, backward), gradients out
    into = "in before each gather (forward and backward)"
    assert r["cost"] == f"offload: {moved:.2f} GiB host<->device per step (sharded parameters {into}, gradients out)"
    once = points.model_row(c, "fsdp_grad_op", 2, shapes, "cpu", "offload", peak=_peak([512.0, 512.0], {"params": 1.0}))
    moved = 2 * N * 4 / 2 / GIB  # no re-gather for the backward: parameters in once
    assert once["cost"] == f"offload: {moved:.2f} GiB host<->device per step (sharded parameters in, gradients out)"


def _shared(per_rank_mib, reserved_extra_mib, share=True):
    """A composed peak whose allocator figures are the shallow fake's share of the peak
    (``share``) or replayed over a drawn trace; its device total is the peak plus
    ``reserved_extra_mib``, 32 MiB of it the CUDA context (what ``fits`` compares: the device total)."""
    allocator = {"allocated_extra_mib": 0.0, "reserved_extra_mib": reserved_extra_mib - 32.0, "fragmentation_mib": 0.0,
                 "context_mib": 32.0, "context_source": "none", "alloc_conf": None, "streams": ["default"],
                 "depth": "made up"} | ({"share_of_peak": True} if share else {})  # fmt: skip
    return _peak(per_rank_mib, {"params": 1.0}) | {"method": "composed by depth", "allocator": allocator}


@pytest.mark.parametrize(
    "reserved_extra_mib, whole",
    [(132.0, True), (1024.0 - 800.0, True), (100.0, False), (300.0, False)],
    ids=["9-percent-under", "at-the-limit", "12-percent-under", "over"],
)
def test_a_share_of_the_peak_close_under_the_device_is_faked_whole(raw_cfg, monkeypatch, reserved_extra_mib, whole):
    """On a 1 GiB device, a composed peak of 800 MiB: its device total (800 MiB + the reserved
    extra) within 10% under 1,024 MiB (above 921.6: 932) is faked whole, at the limit too; 900
    MiB (12% under) is not, nor is 1,100 (over: said not to fit, the safe side)."""
    shapes = points.raw_shapes(N, 32, 2)
    c = raw_cfg.copy()
    c.plan.params = None
    faked = []
    whole_peak = _peak([1000.0, 1000.0], {"params": 2.0}) | {"method": "fake step", "allocator": None}
    monkeypatch.setattr(points, "predict_peak", lambda *a, **k: faked.append(a[1]) or dict(whole_peak))
    r = points.model_row(c, "ddp", 2, shapes, "cuda", peak=_shared([800.0, 800.0], reserved_extra_mib))
    assert faked == ([2] if whole else [])
    if whole:
        assert r["method"] == "fake step" and r["total_gib"] == pytest.approx(1000 / 1024)
        assert r["note"] == f"a note; {points.SETTLED}"
        assert "within 10% under" in points.SETTLED
        assert r["seconds"] == 3.0  # the whole fake's and the shallow fakes' before it
    else:
        assert r["method"] == "composed by depth"
        assert r["device_total_gib"] == pytest.approx((800 + reserved_extra_mib) / 1024)
        assert r["fits"] is (800 + reserved_extra_mib <= 1024)


def test_a_share_of_the_peak_whose_whole_model_cannot_be_faked_keeps_it_and_says_so(raw_cfg, monkeypatch):
    shapes = points.raw_shapes(N, 32, 2)
    c = raw_cfg.copy()
    c.plan.params = None
    monkeypatch.setattr(points, "predict_peak", lambda *a, **k: {"per_rank_mib": None, "error": "too deep"})
    r = points.model_row(c, "ddp", 2, shapes, "cuda", peak=_shared([800.0, 800.0], 132.0))
    assert r["method"] == "composed by depth" and r["fits"] is True
    assert r["note"] == "a note; not settled: the whole model could not be faked (too deep)"


def test_a_drawn_reserved_figure_close_under_the_device_is_kept(raw_cfg, monkeypatch):
    """Replayed over a trace drawn to full depth (no ``share_of_peak``), a row 9% under the
    device's memory keeps its composed figures: nothing is faked whole."""
    shapes = points.raw_shapes(N, 32, 2)
    c = raw_cfg.copy()
    c.plan.params = None
    monkeypatch.setattr(points, "predict_peak", lambda *a, **k: pytest.fail("faked whole"))
    r = points.model_row(c, "ddp", 2, shapes, "cuda", peak=_shared([800.0, 800.0], 132.0, share=False))
    assert r["method"] == "composed by depth" and r["fits"] is True
    assert not points.settled_whole({"per_rank_mib": None, "allocator": {"share_of_peak": True}}, 1.0)


def test_a_point_without_a_peak_is_said_by_its_error(raw_cfg):
    shapes = points.raw_shapes(N, 32, 2)
    c = raw_cfg.copy()
    c.plan.params = None
    r = points.model_row(c, "ddp", 2, shapes, "cpu", peak={"per_rank_mib": None, "error": "too big"})
    assert r["total_gib"] is None and r["mean_gib"] is None and r["fits"] is None
    assert r["note"] == "too big" and r["method"] == "none"
    assert all(r[f"{p}_gib"] is None for p in points.PARTS)
    assert r["model_states_gib"] == pytest.approx(4 * N * 4 / GIB, rel=1e-5)


def test_levers_say_what_they_cost():
    prediction = {"model_states_mib": [{"params": 1024.0, "grads": 512.0, "optimizer": 4096.0},
                                       {"params": 10.0, "grads": 10.0, "optimizer": 10.0}]}  # fmt: skip
    assert points._cost_note("none", prediction) == ""
    assert points._cost_note("ac", prediction).startswith("recompute: one more forward")
    assert points._cost_note("ac_selective", prediction).startswith("recompute: the units' cheap ops")
    assert points._cost_note("ac+offload", prediction).endswith(
        "; offload: 2.50 GiB host<->device per step (sharded parameters in before each gather (forward and "
        "backward), gradients out)"
    )
    assert points._cost_note("offload", prediction, regathers=False) == (
        "offload: 1.50 GiB host<->device per step (sharded parameters in, gradients out)"
    )


# ------------------------------------------------------------------------ the cheapest
def _fit(strategy, ws, total, levers="none", fits=True):
    return {"strategy": strategy, "world_size": ws, "total_gib": total, "levers": levers, "fits": fits}


def test_the_cheapest_point_that_fits_per_world_size():
    rows = [_fit("ddp", 8, 90.0, fits=False), _fit("fsdp", 8, 10.0), _fit("zero1", 8, 60.0),
            _fit("oss", 8, 59.0), _fit("ddp", 8, 70.0, levers="ac"),
            _fit("fsdp", 2, 30.0, levers="ac"), _fit("fsdp", 2, 30.0, levers="offload"),
            _fit("ddp", 64, 90.0, fits=False)]  # fmt: skip
    best = points.cheapest(rows)
    assert [(b["world_size"], b["strategy"], b["levers"]) for b in best] == [(2, "fsdp", "ac"), (8, "oss", "none")]


# ---------------------------------------------------------------------- the search
def test_the_crossing_of_a_line_with_the_budget_rounded_down():
    assert points._crossing({1: 1.0, 2: 2.0}, {}, 5.5, 2, None) == 5  # peak = value
    assert points._crossing({1: 1.0, 2: 2.0, 9: 9.0}, {}, 5.5, 2, 9) == 5  # the line to hi
    assert points._crossing({2: 2.0}, {}, 5.5, 2, None) == 4  # no line: twice lo
    assert points._crossing({1: 2.0, 2: 2.0}, {}, 5.5, 2, None) == 4  # flat: twice lo
    assert points._crossing({1: 3.0, 2: 2.0}, {}, 5.5, 2, None) == 4  # falling: twice lo


def test_the_first_phase_to_reach_the_budget_decides_the_crossing():
    probes = {1: 2.0, 2: 3.0}
    phases = {1: {"step": 2.0, "optimizer": 1.5}, 2: {"step": 3.0, "optimizer": 3.0}}
    # step reaches 10 at 9, the optimizer step (1.5 per unit) at 6.67
    assert points._crossing(probes, phases, 10.0, 2, None) == 6
    # phases unknown at one probe: the peak's own line
    assert points._crossing(probes, {1: {}, 2: phases[2]}, 10.0, 2, None) == 9


def _search(monkeypatch, peak, host=None, knob="trainer.batch_size"):
    """Stub fake steps: ``peak(value)`` GiB on the device; ``host(value)``: the node's host
    memory and its budget (CPU offload), or None."""
    calls = []

    def peak_gib(c, world_size, device_type, errors, combo="none"):
        value = OmegaConf.select(c, knob)
        calls.append(value)
        gib = peak(value)
        if gib is None:
            errors.append(f"no fake at {value}")
        return gib, {}, host(value) if host else None

    monkeypatch.setattr(points, "_peak_gib", peak_gib)
    return calls


def test_the_largest_batch_that_fits_is_bracketed_in_four_fake_steps(plan_cfg, monkeypatch):
    c = plan_cfg.copy()
    c.plan.device_memory_gib = 1.05
    calls = _search(monkeypatch, lambda b: 0.3 + 0.1 * b)
    found = points.largest(c, "ddp", 2, "trainer.batch_size", "cpu")
    assert found["value"] == 7  # 1.0 GiB fits 1.05, 1.1 does not
    assert sorted(calls) == [1, 2, 7, 8]
    assert found["note"] == "checked by fake steps at 7 and 8"
    assert set(found["probes"]) == {1, 2, 7, 8}


def test_a_bending_peak_is_bracketed_all_the_same(plan_cfg, monkeypatch):
    c = plan_cfg.copy()
    c.plan.device_memory_gib = 100.0
    _search(monkeypatch, lambda b: b * b / 10)  # fits up to 31 (96.1), not 32 (102.4)
    found = points.largest(c, "ddp", 2, "trainer.batch_size", "cpu")
    assert found["value"] == 31 and found["note"] == "checked by fake steps at 31 and 32"


def test_a_knob_that_does_not_fit_at_one_is_zero(plan_cfg, monkeypatch):
    c = plan_cfg.copy()
    c.plan.device_memory_gib = 0.5
    _search(monkeypatch, lambda b: 0.6 * b)
    found = points.largest(c, "ddp", 2, "trainer.batch_size", "cpu")
    assert found == {"value": 0, "probes": {1: 0.6, 2: 1.2}, "note": "trainer.batch_size=1 does not fit"}
    c.plan.device_memory_gib = 1.0  # 1 fits, 2 does not
    assert points.largest(c, "ddp", 2, "trainer.batch_size", "cpu")["value"] == 1


def test_a_search_without_a_fake_step_says_why(plan_cfg, monkeypatch):
    _search(monkeypatch, lambda b: None if b == 2 else 0.1)
    found = points.largest(plan_cfg, "ddp", 2, "trainer.batch_size", "cpu")
    assert found["value"] is None and found["note"] == "no fake step: no fake at 2"


def test_a_knob_that_always_fits_stops_at_the_limit(plan_cfg, monkeypatch):
    calls = _search(monkeypatch, lambda b: 0.001)
    found = points.largest(plan_cfg, "ddp", 2, "trainer.batch_size", "cpu", limit=16)
    assert found["value"] == 16 and found["note"] == "fits up to the limit 16"
    assert max(calls) == 16


def test_an_offloaded_depth_stops_where_the_nodes_host_memory_does(gpt_cfg, monkeypatch):
    """Host memory grows by the same pinned blocks each layer: 10 + 5 per layer GiB against a
    node of 50 holds 8 layers (50 GiB), whatever the device would take (0.1 GiB a layer of 80)."""
    c = gpt_cfg.copy()
    calls = _search(monkeypatch, lambda n: 0.1 * n, host=lambda n: (10.0 + 5.0 * n, 50.0), knob="model.n_layers")
    found = points.largest(c, "fsdp", 8, "model.n_layers", "cuda", combo="offload")
    assert found["value"] == 8 and max(calls) == 8
    assert found["note"] == "the node's host memory (CPU offload) holds model.n_layers=8 and no more"
    _search(monkeypatch, lambda n: 0.1 * n, host=lambda n: (60.0 + 5.0 * n, 50.0), knob="model.n_layers")
    found = points.largest(c, "fsdp", 8, "model.n_layers", "cuda", combo="offload")
    assert found["value"] == 0 and "does not fit the node's host memory" in found["note"]
    # a batch does not grow the host: the device decides
    _search(monkeypatch, lambda b: 0.3 + 0.1 * b, host=lambda b: (20.0, 50.0))
    c.plan.device_memory_gib = 1.05
    assert points.largest(c, "fsdp", 8, "trainer.batch_size", "cuda", combo="offload")["value"] == 7
    assert points.host_cap((20.0, 50.0), (20.0, 50.0)) is None and points.host_cap(None, None) is None


def test_find_rows_search_every_point_and_name_their_probes(plan_cfg, monkeypatch):
    seen = []

    def largest(cfg, name, ws, knob, device_type, combo="none"):
        seen.append((name, combo, ws, knob))
        return {"value": ws, "probes": {1: 0.5, 2: 1.0}, "note": "n"}

    monkeypatch.setattr(points, "largest", largest)
    c = plan_cfg.copy()
    c.plan.strategies, c.plan.levers, c.plan.find = ["ddp", "fsdp"], ["none", "offload"], "depth"
    stream = io.StringIO()
    rows = points.find_rows(c, [2, 8], "cpu", Progress(4, stream=stream))
    assert seen == [("ddp", "none", 2, "model.n_layers"), ("ddp", "none", 8, "model.n_layers"),
                    ("fsdp", "none", 2, "model.n_layers"), ("fsdp", "none", 8, "model.n_layers"),
                    ("fsdp", "offload", 2, "model.n_layers"), ("fsdp", "offload", 8, "model.n_layers")]  # fmt: skip
    assert rows[4] == {"strategy": "fsdp", "levers": "offload", "world_size": 2, "find": "depth", "value": 2,
                       "probes": {"1": 0.5, "2": 1.0}, "note": "n"}  # fmt: skip
    assert "depth of fsdp + offload x8: 8" in stream.getvalue().splitlines()[-1]
    c.plan.find = "batch_size"
    points.find_rows(c, [2], "cpu")
    assert seen[-1][3] == "trainer.batch_size"


# ------------------------------------------------------------------- workers and rows
def test_a_raw_count_is_planned_in_this_process(raw_cfg):
    c = raw_cfg.copy()
    c.plan.workers = 8
    assert points.workers(c, 6) == 1


def test_workers_are_as_many_as_asked_but_no_more_than_the_points(plan_cfg):
    c = plan_cfg.copy()
    c.plan.workers = 4
    assert points.workers(c, 6) == 4 and points.workers(c, 2) == 2
    c.plan.workers = 1
    assert points.workers(c, 6) == 1


def test_workers_0_is_one_per_core_from_1e8_parameters(plan_cfg, monkeypatch):
    import os
    from types import SimpleNamespace

    c = plan_cfg.copy()
    c.plan.workers = 0
    assert points.workers(c, 6) == 1  # the MLP: faster in this process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(points, "shapes_of", lambda cfg: SimpleNamespace(params=points.SIDE_BY_SIDE_FROM))
    assert points.workers(c, 6) == 3 and points.workers(c, 2) == 2
    monkeypatch.setattr(points, "shapes_of", lambda cfg: SimpleNamespace(params=points.SIDE_BY_SIDE_FROM - 1))
    assert points.workers(c, 6) == 1


def test_rows_come_in_the_order_of_the_points_then_the_world_sizes(raw_cfg):
    c = raw_cfg.copy()
    c.plan.strategies = ["fsdp", "ddp"]
    stream = io.StringIO()
    rows = points.plan_rows(c, [8, 2], "cpu", Progress(4, stream=stream))
    assert [(r["strategy"], r["world_size"]) for r in rows] == [("fsdp", 8), ("fsdp", 2), ("ddp", 8), ("ddp", 2)]
    lines = stream.getvalue().splitlines()
    assert [line.split()[1:3] for line in lines] == [["2/4", "fsdp"], ["4/4", "ddp"]]
    one = io.StringIO()
    points.plan_rows(c, [64], "cpu", Progress(2, stream=one))
    assert one.getvalue().splitlines()[0].split()[1:4] == ["1/2", "fsdp", "x64"]


def test_what_the_fake_steps_stand_for(raw_cfg, plan_cfg):
    c = raw_cfg.copy()
    c.plan.device = "cpu"
    assert points.faked(c) == "cpu (a raw count is analytic: nothing is faked)"
    c = plan_cfg.copy()
    c.plan.device = "cpu"
    assert points.faked(c) == "cpu (the kernels a CPU run uses)"


def test_beyond_every_line_a_raw_count_is_said_not_planned_for_minutes(raw_cfg, monkeypatch):
    """A strategy whose figures follow no line in any window gets a row saying so (seconds),
    not an exact plan at millions of ranks (minutes, gigabytes)."""
    calls = []

    def curved(cfg, name, world_size):
        calls.append(world_size)
        return {"params": 1.0 / world_size**2}  # no a + b / world_size

    monkeypatch.setattr(points, "_raw_parts", curved)
    r = points.raw_row(raw_cfg, "ddp", 10**6)
    assert r["total_gib"] is None and r["fits"] is None and r["method"] == "none"
    assert "planned up to 16,384 ranks" in r["note"] and "1,000,000 ranks was asked" in r["note"]
    assert max(calls) == 16384


def test_a_line_that_holds_only_past_a_regime_change_answers_beyond_it(raw_cfg, monkeypatch):
    def bent(cfg, name, world_size):
        return {"params": 3.0 + 4096.0 / world_size if world_size >= 4096 else 1.0 / world_size**2}

    monkeypatch.setattr(points, "_raw_parts", bent)
    r = points.raw_row(raw_cfg, "ddp", 10**6)
    assert r["params_gib"] == pytest.approx(3.0 + 4096.0 / 10**6)
    assert r["note"] == "from the exact plans at 4096, 8192 and 16384 ranks (every figure is a + b/world_size)"


# ------------------------------------------------------------------ the allocator's columns and fits
ALLOCATOR = {"allocated_extra_mib": 10.24, "reserved_extra_mib": 1024.0, "fragmentation_mib": 512.0, "segments": 3,
             "streams": ["default"], "alloc_conf": "", "context_mib": 512.0, "context_source": "s"}  # fmt: skip


def test_allocator_columns_ride_on_the_peak_and_add_the_context():
    cols = points.allocator_columns(10.0, ALLOCATOR)
    assert cols["allocated_gib"] == pytest.approx(10.01)
    assert cols["reserved_gib"] == 11.0 and cols["device_total_gib"] == 11.5
    assert cols["fragmentation_gib"] == 0.5 and cols["context_gib"] == 0.5


def test_without_an_allocator_allocated_is_the_peak_and_nothing_is_reserved():
    assert points.allocator_columns(10.0, None) == {
        "allocated_gib": 10.0,
        "reserved_gib": None,
        "device_total_gib": None,
    }
    assert points.allocator_columns(None, ALLOCATOR)["allocated_gib"] is None


def test_fits_holds_the_device_total_where_modelled_else_the_peak():
    cuda = {"total_gib": 10.0, **points.allocator_columns(10.0, ALLOCATOR)}
    assert points.fits(cuda, 11.5) is True and points.fits(cuda, 11.4) is False  # the peak alone would fit
    cpu = {"total_gib": 10.0, **points.allocator_columns(10.0, None)}
    assert points.fits(cpu, 10.0) is True and points.fits(cpu, 9.9) is False
    assert points.fits({"total_gib": None, "device_total_gib": None}, 80.0) is None


def test_an_allocator_not_modelled_still_holds_the_context_against_the_device():
    """backend:cudaMallocAsync (the driver's pool): no reserved figure, but the CUDA context is
    on the device all the same: 10 GiB of tensors + the context do not fit 10 GiB."""
    row = {"total_gib": 10.0, **points.allocator_columns(10.0, None)}
    row |= points.unmodelled_allocator(10.0, "backend:cudaMallocAsync")
    assert row["reserved_gib"] is None and row["device_total_gib"] is None and row["allocated_gib"] == 10.0
    assert row["context_gib"] > 0 and row["alloc_conf"] == "backend:cudaMallocAsync"
    assert points.fit_basis(row) == 10.0 + row["context_gib"]
    assert points.fits(row, 10.0) is False and points.fits(row, 10.0 + row["context_gib"]) is True


def test_cheapest_asks_fits_not_the_peak():
    near = {"strategy": "ddp", "world_size": 8, "levers": "none", "total_gib": 79.0}
    near |= points.allocator_columns(79.0, ALLOCATOR)
    near["fits"] = points.fits(near, 80.0)
    assert near["fits"] is False and points.cheapest([near]) == []
