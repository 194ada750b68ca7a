"""sharded_exp/plan/depth.py: a deep model's peak composed from fake steps of shallow copies.

The line checks (:func:`rules_on_line`, :func:`same_lines`), the drawing at full depth
(:func:`compose`), the split of one fake step into lines and ratios (:func:`fake_at`, with
the fake step itself replaced by a made-up peak) and the orchestration over world sizes
(:func:`peaks_by_depth`, with :func:`fake_at` replaced by made-up fakes whose lines are
known), all without a single real fake step.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sharded_exp.plan import depth
from sharded_exp.plan.depth import ABS, REL, STEP_TEMPORARIES, Fake

MIB = 2**20


def fake(d: int, lines: dict, ratios: dict | None = None, raw: dict | None = None, seconds: float = 0.0,
         note: str = "", setup_clear: bool = True) -> Fake:  # fmt: skip
    """A made-up fake step at depth ``d`` (raw, the checks' scale: the lines themselves)."""
    ratios = {phase: None for phase in lines} if ratios is None else ratios
    raw = {phase: dict(parts) for phase, parts in lines.items()} if raw is None else raw
    return Fake(d, lines, ratios, raw, seconds, note, setup_clear)


def on_line(d: int, ratio: float | None = 0.5) -> Fake:
    """Every part a line in depth: activations 1 + 2d, grads beyond the state -0.1d, the
    optimizer step's temporaries 0.3d (in the optimizer phase, with ``ratio``)."""
    lines = {
        "step": {"activations": 1.0 + 2.0 * d, "grads": -0.1 * d},
        "optimizer": {"activations": 0.5, STEP_TEMPORARIES: 0.3 * d},
    }
    return fake(d, lines, {"step": 0.0, "optimizer": ratio})


# ------------------------------------------------------------------------------ the lines
def test_a_third_depth_on_the_lines_through_the_first_two_is_accepted_with_the_ratio_rule():
    rules = depth.rules_on_line(on_line(1), on_line(2), on_line(3))
    assert rules == {"step": "ratio", "optimizer": "ratio"}


def test_temporaries_whose_ratio_to_the_state_moves_grow_on_a_line_instead():
    a, b, c = on_line(1, ratio=0.5), on_line(2, ratio=0.6), on_line(3, ratio=0.7)
    assert depth.rules_on_line(a, b, c) == {"step": "ratio", "optimizer": "line"}
    # no ratio at all (a rank that steps no optimizer state): a line as well
    a, b, c = on_line(1, ratio=None), on_line(2, ratio=None), on_line(3, ratio=None)
    assert depth.rules_on_line(a, b, c)["optimizer"] == "line"


def test_a_part_off_the_line_beyond_the_tolerance_bends_it():
    c = on_line(3)
    scale = c.raw["step"]["activations"]
    c.lines["step"]["activations"] += 2 * (REL * scale + ABS)
    assert depth.rules_on_line(on_line(1), on_line(2), c) is None


def test_a_part_off_the_line_within_the_tolerance_keeps_it():
    c = on_line(3)
    c.lines["step"]["activations"] += 0.5 * ABS
    assert depth.rules_on_line(on_line(1), on_line(2), c) == {"step": "ratio", "optimizer": "ratio"}


def test_temporaries_off_their_line_are_no_bend_where_they_follow_the_state():
    c = on_line(3, ratio=0.5)
    c.lines["optimizer"][STEP_TEMPORARIES] = 10.0  # far off the line 0.3d, but the same ratio
    assert depth.rules_on_line(on_line(1), on_line(2), c) == {"step": "ratio", "optimizer": "ratio"}
    c = on_line(3, ratio=0.9)  # nor a ratio that holds: bent
    c.lines["optimizer"][STEP_TEMPORARIES] = 10.0
    assert depth.rules_on_line(on_line(1), on_line(2), c) is None


def test_the_third_depth_is_checked_as_many_steps_along_as_it_lies_from_the_second():
    """Depths 1, 2, 4: the line through the first two is read two steps past the second."""
    assert depth.rules_on_line(on_line(1), on_line(2), on_line(4)) is not None
    c = on_line(4)
    c.depth = 3  # the values of depth 4 at depth 3: one step along, they are off the line
    assert depth.rules_on_line(on_line(1), on_line(2), c) is None


def test_fakes_with_different_phases_have_no_common_lines():
    c = on_line(3)
    del c.lines["optimizer"]
    assert depth.rules_on_line(on_line(1), on_line(2), c) is None


def test_the_same_lines_at_two_world_sizes():
    rules = {"step": "ratio", "optimizer": "ratio"}
    assert depth.same_lines(on_line(1), on_line(1), rules)
    moved = on_line(1)
    moved.lines["step"]["activations"] += 1.0
    assert not depth.same_lines(on_line(1), moved, rules)
    fewer = on_line(1)
    del fewer.lines["optimizer"]
    assert not depth.same_lines(on_line(1), fewer, rules)


def test_temporaries_that_follow_the_state_are_compared_by_their_ratio():
    a, b = on_line(1, ratio=0.5), on_line(1, ratio=0.5)
    b.lines["optimizer"][STEP_TEMPORARIES] = 7.0  # another shard stepped, the same ratio to it
    assert depth.same_lines(a, b, {"optimizer": "ratio"})
    assert not depth.same_lines(a, b, {"optimizer": "line"})  # as a line, they moved
    c = on_line(1, ratio=0.8)
    assert not depth.same_lines(a, c, {"optimizer": "ratio"})


# ------------------------------------------------------------------- drawn at full depth
STATES = [{"params": 1.0, "grads": 1.0, "optimizer": 2.0}, {"params": 3.0, "grads": 3.0, "optimizer": 6.0}]


def test_compose_draws_each_line_to_full_depth_over_the_largest_ranks_states():
    a, b = on_line(1), on_line(2)
    rules = {"step": "line", "optimizer": "line"}
    phases = depth.compose(a, b, 10, {"model_states_mib": STATES}, rules, stepped=100.0)
    total, parts = phases["step"]
    assert parts["activations"] == pytest.approx(1.0 + 2.0 * 10)
    assert parts["grads"] == pytest.approx(-0.1 * 10 + 3.0)  # rank 1's states are the largest
    assert parts["params"] == pytest.approx(3.0) and parts["optimizer"] == pytest.approx(6.0)
    assert total == pytest.approx(sum(parts.values()))
    _, parts = phases["optimizer"]
    assert parts[STEP_TEMPORARIES] == pytest.approx(0.3 * 10)  # on its line
    assert parts["activations"] == pytest.approx(0.5)


def test_compose_sets_temporaries_that_follow_the_state_from_the_state_stepped_at_full_depth():
    a, b = on_line(1, ratio=0.5), on_line(2, ratio=0.5)
    phases = depth.compose(a, b, 10, {"model_states_mib": STATES}, {"optimizer": "ratio"}, stepped=40.0)
    assert phases["optimizer"][1][STEP_TEMPORARIES] == pytest.approx(0.5 * 40.0)


def test_a_part_drawn_below_zero_is_none_at_all():
    a = fake(1, {"step": {"activations": 5.0}})
    b = fake(2, {"step": {"activations": 3.0}})  # falling: -2 per block, below 0 at 10 blocks
    total, parts = depth.compose(a, b, 10, {"model_states_mib": STATES}, {}, stepped=0.0)["step"]
    assert parts["activations"] == 0.0
    assert total == pytest.approx(3.0 + 3.0 + 6.0)


def test_the_shallowest_depth_on_the_line_is_the_strategys():
    assert depth.first_depth("ddp") == 1
    assert depth.first_depth("fsdp") == 3  # the root unit and the first blocks are no line yet


# ------------------------------------------------------------------ one fake, split up
def _numels(cfg, n_layers: int) -> tuple[int, int]:
    """(all parameters, the 2-D weights: the decayed group) of the model cut to ``n_layers``."""
    params = _params(cfg, n_layers)
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.ndim >= 2)


def _params(cfg, n_layers: int) -> list:
    from sharded_exp.predict.prediction import meta_model

    c = cfg.copy()
    c.model.n_layers = n_layers
    return list(meta_model(c.model).parameters())


def _adam_mib(params) -> float:
    """Adam's state: two fp32 moments per element and an fp32 step count per tensor."""
    return (sum(p.numel() for p in params) * 2 * 4 + len(params) * 4) / MIB


def made_up_peak(seen: list, extra_grads: float = 0.25, activations: float = 3.0, temporaries=None, error=None):
    """A stand-in for predict_peak: the rank's analytic states plus known extras."""

    def predict_peak(c, world_size, device_type, prediction, shapes, flops=False, keep_trace=False):
        seen.append(c.model.n_layers)
        if error:
            return {"per_rank_mib": None, "error": error}
        mine = prediction["model_states_mib"][0]
        step = {**mine, "grads": mine["grads"] + extra_grads, "activations": activations}
        opt = {**mine, "activations": 0.0, STEP_TEMPORARIES: temporaries(mine) if temporaries else 0.0}
        phases = {"step": (sum(step.values()), step), "optimizer": (sum(opt.values()), opt)}
        return {"per_rank_mib": [1.0, 1.0], "rank": 0, "phases_mib": phases, "seconds": 0.25, "note": "said"}

    return predict_peak


def test_a_fake_step_is_split_into_lines_beyond_the_ranks_states(gpt_cfg, monkeypatch):
    seen: list = []
    monkeypatch.setattr(depth, "predict_peak", made_up_peak(seen, extra_grads=0.25, activations=3.0))
    f = depth.fake_at(gpt_cfg, "n_layers", 2, 2, "cpu")
    assert seen == [2]  # the model cut to 2 blocks is what is faked
    assert gpt_cfg.model.n_layers == 6  # the caller's config is untouched
    numel, _ = _numels(gpt_cfg, 2)
    mib = numel * 4 / MIB  # DDP, fp32: every rank holds every parameter
    assert f.depth == 2 and f.seconds == 0.25 and f.note == "said"
    assert f.raw["step"]["params"] == pytest.approx(mib)
    assert f.lines["step"]["params"] == pytest.approx(0.0, abs=1e-12)
    assert f.lines["step"]["grads"] == pytest.approx(0.25)
    assert f.lines["step"]["optimizer"] == pytest.approx(0.0, abs=1e-12)
    assert f.lines["step"]["activations"] == 3.0  # not a state: drawn as faked
    assert f.setup_clear  # DDP sets up nothing on top


def test_the_step_temporaries_ratio_is_to_the_largest_groups_optimizer_state(gpt_cfg, monkeypatch):
    stepped = _adam_mib([p for p in _params(gpt_cfg, 2) if p.ndim >= 2])  # the 2-D weights: the largest group
    monkeypatch.setattr(depth, "predict_peak", made_up_peak([], temporaries=lambda mine: 0.5 * stepped))
    f = depth.fake_at(gpt_cfg, "n_layers", 2, 2, "cpu")
    assert f.ratios["optimizer"] == pytest.approx(0.5)
    assert f.ratios["step"] == 0.0


def test_an_optimizer_without_state_has_no_ratio(gpt_cfg, monkeypatch):
    c = gpt_cfg.copy()
    c.optimizer.name, c.optimizer.momentum = "sgd", 0.0
    monkeypatch.setattr(depth, "predict_peak", made_up_peak([]))
    f = depth.fake_at(c, "n_layers", 2, 2, "cpu")
    assert f.ratios == {"step": None, "optimizer": None}


def test_a_fake_step_that_fails_is_said_by_its_error(gpt_cfg, monkeypatch):
    monkeypatch.setattr(depth, "predict_peak", made_up_peak([], error="out of ideas"))
    assert depth.fake_at(gpt_cfg, "n_layers", 1, 2, "cpu") == "out of ideas"


def test_a_set_up_moment_below_the_first_phases_peak_is_clear_of_it(gpt_cfg):
    from sharded_exp.strategies import STRATEGIES

    c = gpt_cfg.copy()
    c.strategy = STRATEGIES.config_class("sharded_ddp")()
    shapes = depth.shapes_of(c)
    transient = STRATEGIES.builder("sharded_ddp").memory.setup_transient_mib(c.strategy, shapes, 4)
    assert transient > 0
    mine = {"params": 1.0, "grads": 1.0, "optimizer": 2.0}
    top = 4.0 + transient
    assert depth._setup_clear(c, shapes, 4, mine, {"step": top + 0.01, "optimizer": 0.0})
    assert not depth._setup_clear(c, shapes, 4, mine, {"step": top - 0.01, "optimizer": 1e9})
    # no "step" phase: the largest phase's peak
    assert depth._setup_clear(c, shapes, 4, mine, {"optimizer": top + 0.01})
    # a strategy without a set-up moment is always clear
    assert depth._setup_clear(gpt_cfg, shapes, 4, mine, {"step": 0.0})


# ------------------------------------------------------------ world sizes, orchestrated
class Fakes:
    """A stand-in for fake_at: lines known in depth (and, if asked, in world size)."""

    def __init__(self, slope=lambda ws: 2.0, bend_at=None, fail_at=None, clear=True):
        self.slope, self.bend_at, self.fail_at, self.clear = slope, bend_at, fail_at, clear
        self.calls: list[tuple[int, int]] = []

    def __call__(self, cfg_s, key, d, ws, device_type):
        self.calls.append((d, ws))
        if self.fail_at == (d, ws):
            return "no fake here"
        activations = 1.0 + self.slope(ws) * d + (5.0 if self.bend_at == (d, ws) else 0.0)
        lines = {"step": {"activations": activations, "grads": -0.001 * d},
                 "optimizer": {"activations": 0.5, STEP_TEMPORARIES: 0.0}}  # fmt: skip
        return fake(d, lines, {"step": None, "optimizer": None}, seconds=0.5, note="fake note",
                    setup_clear=self.clear)  # fmt: skip


def _ddp_states_mib(cfg) -> dict[str, float]:
    params = _params(cfg, cfg.model.n_layers)
    mib = sum(p.numel() for p in params) * 4 / MIB
    return {"params": mib, "grads": mib, "optimizer": _adam_mib(params)}


def test_ddp_is_drawn_once_and_reused_where_its_lines_do_not_move(gpt_cfg, monkeypatch):
    fakes = Fakes()
    monkeypatch.setattr(depth, "fake_at", fakes)
    out = depth.peaks_by_depth(gpt_cfg, [2, 8], "cpu", "n_layers", 6)
    assert fakes.calls == [(1, 2), (2, 2), (3, 2), (1, 8)]
    assert out[2]["fakes"] == 3 and out[8]["fakes"] == 1
    assert out[2]["seconds"] == pytest.approx(1.5) and out[8]["seconds"] == pytest.approx(0.5)
    assert "n_layers=6: drawn from 1 and 2 blocks (checked at 3)" in out[2]["note"]
    assert "(as at 2 ranks: unchanged at 1 blocks)" in out[8]["note"]
    assert "fake note" in out[2]["note"]
    assert out[2]["method"] == "composed by depth: fake steps at 1, 2, 3 blocks, drawn to the model's depth"


def test_the_composed_peak_is_the_lines_at_full_depth_over_the_full_models_states(gpt_cfg, monkeypatch):
    monkeypatch.setattr(depth, "fake_at", Fakes())
    peak = depth.peaks_by_depth(gpt_cfg, [2], "cpu", "n_layers", 6)[2]
    states = _ddp_states_mib(gpt_cfg)
    step = peak["phases_mib"]["step"][1]
    assert step["activations"] == pytest.approx(1.0 + 2.0 * 6)
    assert step["grads"] == pytest.approx(states["grads"] - 0.006)
    assert step["params"] == pytest.approx(states["params"])
    assert step["optimizer"] == pytest.approx(states["optimizer"])
    expected = sum(states.values()) - 0.006 + 13.0
    assert peak["breakdown_mib"] == step  # the larger phase
    assert peak["rank"] == 0
    assert peak["per_rank_mib"] == pytest.approx([expected, expected])  # DDP: every rank alike


def test_lines_that_move_with_the_world_size_are_redrawn_there(gpt_cfg, monkeypatch):
    fakes = Fakes(slope=lambda ws: float(ws))
    monkeypatch.setattr(depth, "fake_at", fakes)
    out = depth.peaks_by_depth(gpt_cfg, [2, 8], "cpu", "n_layers", 6)
    assert fakes.calls == [(1, 2), (2, 2), (3, 2), (1, 8), (2, 8), (3, 8)]
    assert out[8]["fakes"] == 3  # the one at the first depth (which said the lines moved) and two more
    assert "redrawn at 8 ranks, checked at 3" in out[8]["note"]
    assert out[8]["phases_mib"]["step"][1]["activations"] == pytest.approx(1.0 + 8.0 * 6)


def test_a_strategy_whose_lines_depend_on_the_world_size_is_redrawn_at_each(gpt_cfg, monkeypatch):
    from sharded_exp.plan.points import with_strategy

    fakes = Fakes(slope=lambda ws: 400.0)  # activations enough to clear ShardedDDP's set-up buckets
    monkeypatch.setattr(depth, "fake_at", fakes)
    out = depth.peaks_by_depth(with_strategy(gpt_cfg, "sharded_ddp"), [2, 8], "cpu", "n_layers", 6)
    assert fakes.calls == [(1, 2), (2, 2), (3, 2), (1, 8), (2, 8), (3, 8)]  # the same lines, redrawn
    assert out[8] is not None and "redrawn at 8 ranks" in out[8]["note"]


def test_fsdp_is_faked_from_its_own_first_depth(gpt_cfg, monkeypatch):
    from sharded_exp.plan.points import with_strategy

    fakes = Fakes()
    monkeypatch.setattr(depth, "fake_at", fakes)
    out = depth.peaks_by_depth(with_strategy(gpt_cfg, "fsdp"), [2], "cpu", "n_layers", 6)
    assert fakes.calls == [(3, 2), (4, 2), (5, 2)]
    assert "drawn from 3 and 4 blocks" in out[2]["note"]
    assert out[2]["phases_mib"]["step"][1]["activations"] == pytest.approx(1.0 + 2.0 * 6)


def test_a_bent_line_leaves_the_model_to_be_faked_whole(gpt_cfg, monkeypatch):
    monkeypatch.setattr(depth, "fake_at", Fakes(bend_at=(3, 2)))
    assert depth.peaks_by_depth(gpt_cfg, [2], "cpu", "n_layers", 6) == {2: None}


def test_a_failed_shallow_fake_leaves_the_model_to_be_faked_whole(gpt_cfg, monkeypatch):
    monkeypatch.setattr(depth, "fake_at", Fakes(fail_at=(2, 2)))
    assert depth.peaks_by_depth(gpt_cfg, [2], "cpu", "n_layers", 6) == {2: None}


def test_a_world_size_after_a_bent_first_one_draws_its_own_lines(gpt_cfg, monkeypatch):
    fakes = Fakes(bend_at=(3, 2))
    monkeypatch.setattr(depth, "fake_at", fakes)
    out = depth.peaks_by_depth(gpt_cfg, [2, 8], "cpu", "n_layers", 6)
    assert out[2] is None and out[8] is not None
    assert fakes.calls[3:] == [(1, 8), (2, 8), (3, 8)]
    assert "(checked at 3)" in out[8]["note"]


def test_a_set_up_moment_that_may_be_the_peak_leaves_the_model_to_be_faked_whole(gpt_cfg, monkeypatch):
    monkeypatch.setattr(depth, "fake_at", Fakes(clear=False))
    assert depth.peaks_by_depth(gpt_cfg, [2], "cpu", "n_layers", 6) == {2: None}
    # ShardedDDP's set-up buckets (one per destination rank) outgrow small activations
    from sharded_exp.plan.points import with_strategy

    monkeypatch.setattr(depth, "fake_at", Fakes(slope=lambda ws: 0.0))
    assert depth.peaks_by_depth(with_strategy(gpt_cfg, "sharded_ddp"), [8], "cpu", "n_layers", 6) == {8: None}


def test_shapes_are_built_once_per_model_optimizer_and_freeze(gpt_cfg, monkeypatch):
    calls = []
    real = depth.model_shapes
    monkeypatch.setattr(depth, "_SHAPES", {})
    monkeypatch.setattr(depth, "model_shapes", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = depth.shapes_of(gpt_cfg)
    assert depth.shapes_of(gpt_cfg.copy()) is first and len(calls) == 1
    other = gpt_cfg.copy()
    OmegaConf.update(other.model, "n_layers", 2)
    assert depth.shapes_of(other).params < first.params and len(calls) == 2


def test_the_allocators_figures_at_full_depth_keep_their_share_of_the_peak():
    from sharded_exp.plan.depth import Fake, compose_allocator

    allocator = {"tracked_peak_mib": 100.0, "allocated_extra_mib": 1.0, "reserved_extra_mib": 40.0,
                 "fragmentation_mib": 39.0, "context_mib": 426.0, "streams": ["default"]}  # fmt: skip
    b = Fake(5, {}, {}, {}, 0.0, allocator=allocator)
    out = compose_allocator(b, 250.0)
    assert (out["allocated_extra_mib"], out["reserved_extra_mib"], out["fragmentation_mib"]) == (2.5, 100.0, 97.5)
    assert out["context_mib"] == 426.0 and out["streams"] == ["default"]  # not shares of the peak
    assert out["share_of_peak"] is True  # what a row close under the device's memory is faked whole for
    assert compose_allocator(Fake(5, {}, {}, {}, 0.0), 250.0) is None  # CPU: no allocator


def test_the_allocators_figures_at_full_depth_are_replayed_over_the_trace_drawn_there():
    """Three shallow fakes' traces (tests/helpers/traces.py's made-up model at 2, 3 and 4
    blocks) drawn to 7 blocks replay as the 7-block trace does; a fake without a trace (or one
    that does not repeat by block) is not drawn, and the plan keeps the share of the peak, and
    says so."""
    from sharded_exp.plan.depth import Fake, compose_allocator, drawn_allocator
    from sharded_exp.predict.alloc_trace import point_figures
    from tests.helpers.traces import model_trace

    def with_trace(d: int, trace) -> Fake:
        figures = point_figures(trace, "", 0.0)
        return Fake(d, {}, {}, {}, 0.0, allocator=figures, trace=(trace, "", 0.0))

    fakes = [with_trace(n, model_trace(n)) for n in (2, 3, 4)]
    drawn = drawn_allocator(fakes, 7)
    whole = point_figures(model_trace(7), "", 0.0)
    assert drawn["reserved_extra_mib"] == whole["reserved_extra_mib"]
    assert drawn["allocated_extra_mib"] == whole["allocated_extra_mib"]
    assert drawn["depth"] == "replayed over the trace drawn to 7 blocks from 2, 3 and 4"
    assert "share_of_peak" not in drawn
    assert drawn_allocator([fakes[0], fakes[1], with_trace(4, model_trace(6))], 7) is None
    shared = compose_allocator(fakes[1], 123.0)
    assert shared["depth"].startswith("the deeper shallow fake's share of the peak")
    share = fakes[1].allocator["reserved_extra_mib"] / fakes[1].allocator["tracked_peak_mib"]
    assert shared["reserved_extra_mib"] == pytest.approx(share * 123.0)


def test_where_the_shallowest_three_fail_the_allocators_check_it_is_tried_a_block_deeper():
    """The made-up 2-block trace allocates on a stream the deeper ones never use (no block
    step from it): the three are moved one block deeper, 3, 4 and 5 (the fake at 5 asked of
    ``deeper``), where the drawing holds and replays as the 7-block trace does. With no
    deeper fake, or none short of the model's depth, nothing is drawn (the share of the peak
    is kept)."""
    from sharded_exp.plan.depth import DEEPER_CHECKS, Fake, drawn_allocator
    from sharded_exp.predict.alloc_trace import point_figures
    from tests.helpers.traces import MIB, model_trace

    def with_trace(d: int, trace) -> Fake:
        return Fake(d, {}, {}, {}, 0.0, allocator=point_figures(trace, "", 0.0), trace=(trace, "", 0.0))

    odd = model_trace(2) + [("malloc", "odd", MIB, "side")]
    fakes = [with_trace(2, odd), with_trace(3, model_trace(3)), with_trace(4, model_trace(4))]
    asked = []

    def deeper(d: int) -> Fake:
        asked.append(d)
        return with_trace(d, model_trace(d))

    drawn = drawn_allocator(fakes, 7, deeper)
    assert asked == [5] and DEEPER_CHECKS >= 1
    assert drawn["depth"] == "replayed over the trace drawn to 7 blocks from 3, 4 and 5"
    assert drawn["reserved_extra_mib"] == point_figures(model_trace(7), "", 0.0)["reserved_extra_mib"]
    assert drawn_allocator(fakes, 7) is None
    assert drawn_allocator(fakes, 5, deeper) is None
    assert drawn_allocator(fakes, 7, lambda d: "no fake") is None


def test_where_no_two_of_the_three_align_no_deeper_fake_is_asked(monkeypatch):
    """Each made-up trace allocates on a stream of its own (no depth is another's with a block
    inserted, as ShardedDDP's synchronisations and frees move at every depth): the share of the
    peak is kept (nothing drawn) at once, without faking deeper. The world size after the first, whose three
    fakes are the first's, takes the first's drawing without drawing or faking again."""
    from sharded_exp.plan import depth
    from sharded_exp.plan.depth import Fake, _drawing, drawn_allocator
    from sharded_exp.predict.alloc_trace import point_figures
    from tests.helpers.traces import MIB, model_trace

    def with_trace(d: int, own: bool) -> Fake:
        trace = model_trace(d) + ([("malloc", "odd", MIB, f"side {d}")] if own else [])
        return Fake(d, {}, {}, {}, 0.0, allocator=point_figures(trace, "", 0.0), trace=(trace, "", 0.0))

    asked = []

    def deeper(d: int) -> Fake:
        asked.append(d)
        return with_trace(d, own=True)

    assert drawn_allocator([with_trace(n, own=True) for n in (2, 3, 4)], 7, deeper) is None and asked == []
    three, kept = [with_trace(n, own=False) for n in (2, 3, 4)], []
    drawn, made = _drawing(three, three, kept, 7, deeper)
    assert drawn["depth"] == "replayed over the trace drawn to 7 blocks from 2, 3 and 4" and kept == [drawn]
    monkeypatch.setattr(depth, "drawn_allocator", lambda *a, **k: pytest.fail("drawn again"))
    again, made = _drawing(three, three, kept, 7, lambda d: pytest.fail("faked again"))
    assert again is drawn and made == []
    with pytest.raises(pytest.fail.Exception, match="drawn again"):  # other fakes than the first's: drawn
        _drawing(list(three), three, kept, 7, deeper)


def test_a_further_world_size_takes_the_first_ones_three_where_its_two_shallowest_are_theirs():
    """At a world size whose lines are the first's, the second depth is faked too: where both
    shallow traces are the first world size's (ids and the order of frees in a row aside), the
    first's three are taken; where the second is not (a dealt rank holding other tensors there,
    made up as a side allocation at 3 blocks), the third is faked and the three made here are
    drawn from. A CPU fake (no trace) makes no more fakes."""
    from sharded_exp.plan.depth import Fake, _allocator_three
    from tests.helpers.traces import MIB, model_trace

    def with_trace(d: int, side: bool = False) -> Fake:
        trace = model_trace(d) + ([("malloc", "dealt", MIB, "side")] if side else [])
        return Fake(d, {}, {}, {}, 0.0, trace=(trace, "", 0.0))

    first_three = [with_trace(n) for n in (2, 3, 4)]
    asked: list[int] = []

    def fake(d: int, side: bool = False) -> Fake:
        asked.append(d)
        return with_trace(d, side)

    fakes = [with_trace(2)]
    assert _allocator_three(fakes, first_three, fake) is first_three and asked == [3] and len(fakes) == 2
    asked.clear()
    fakes = [with_trace(2)]
    three = _allocator_three(fakes, first_three, lambda d: fake(d, side=d == 3))
    assert three is fakes and asked == [3, 4] and [f.depth for f in three] == [2, 3, 4]
    asked.clear()
    assert _allocator_three([Fake(2, {}, {}, {}, 0.0)], first_three, fake) is None and asked == []


def test_a_strategy_whose_rank_holds_the_same_tensors_at_every_world_size_takes_the_first_three_unfaked():
    """DDP's rank holds the same tensors at every world size: where its shallowest trace is the
    first world size's, the first's three are taken with no fake for the allocator alone; where
    even that trace differs (which DDP's rule says it cannot, but a trace is what is replayed),
    the deeper fakes are made as for any strategy. The memory models say which strategies hold
    the same tensors: DDP's alone of those planned."""
    from sharded_exp.plan.depth import Fake, _allocator_three
    from sharded_exp.strategies import STRATEGIES, memory_of
    from tests.helpers.traces import MIB, model_trace

    def with_trace(d: int, side: bool = False) -> Fake:
        trace = model_trace(d) + ([("malloc", "dealt", MIB, "side")] if side else [])
        return Fake(d, {}, {}, {}, 0.0, trace=(trace, "", 0.0))

    first_three = [with_trace(n) for n in (2, 3, 4)]
    asked: list[int] = []

    def fake(d: int) -> Fake:
        asked.append(d)
        return with_trace(d)

    assert _allocator_three([with_trace(2)], first_three, fake, by_world_size=False) is first_three and asked == []
    three = _allocator_three([with_trace(2, side=True)], first_three, fake, by_world_size=False)
    assert three is not first_three and asked == [3, 4]
    same_everywhere = [n for n in STRATEGIES.names() if not memory_of(n).tensors_by_world_size]
    assert same_everywhere == ["ddp"]  # a strategy that shards inherits DDP's flag only by mistake


def test_a_drawing_by_runs_asks_for_the_fake_a_block_deeper_once():
    """tests/helpers/traces.py's piled trace from 1, 2 and 3 blocks is drawn by runs in place, which
    the fake at 4 blocks would refuse (two copies pile up past the check); whole blocks drawn from
    2 and 3 make that fake's trace event for event, so they are drawn, from the fake at 4 blocks
    asked once, and replay as the 7-block trace does. Where the fake at 4 blocks matches neither
    drawing, it is the next try's third, not asked again."""
    from sharded_exp.plan.depth import Fake, drawn_allocator
    from sharded_exp.predict.alloc_trace import point_figures
    from tests.helpers.traces import piled_trace

    def with_trace(d: int) -> Fake:
        trace = piled_trace(d)
        return Fake(d, {}, {}, {}, 0.0, allocator=point_figures(trace, "", 0.0), trace=(trace, "", 0.0))

    asked = []

    def deeper(d: int) -> Fake:
        asked.append(d)
        return with_trace(d)

    drawn = drawn_allocator([with_trace(n) for n in (1, 2, 3)], 7, deeper)
    assert asked == [4]
    assert drawn["depth"] == "replayed over the trace drawn to 7 blocks from 1, 2 and 3"
    assert drawn["reserved_extra_mib"] == point_figures(piled_trace(7), "", 0.0)["reserved_extra_mib"]
    # a 4-block fake that nothing matches (a 512-byte tensor more): it is the next try's third,
    # not faked again, and each deeper depth is asked once, until the tries run out
    asked.clear()
    odd = piled_trace(4)[:-1] + [("malloc", "x", 512, "default"), ("free", "x", 0, None), piled_trace(4)[-1]]
    four = Fake(4, {}, {}, {}, 0.0, allocator=point_figures(odd, "", 0.0), trace=(odd, "", 0.0))
    assert (
        drawn_allocator(
            [with_trace(n) for n in (1, 2, 3)], 9, lambda d: deeper(d) if d != 4 else asked.append(4) or four
        )
        is None
    )
    assert asked == [4, 5, 6]
