"""A deep model's plan composed from shallow fake steps equals the whole model faked.

The planner fakes each strategy at three shallow depths at its first world size and draws
the rest; at each further world size one shallow fake says whether the lines moved
(sharded_exp/plan/depth.py). The answer must not change: composed and whole-model peaks
(the largest rank's and the mean over ranks) agree within 1%, at several world sizes in
one composition, on the 8-block model of the scale tests and on a Hugging Face model; on CUDA
the reserved memory too (:func:`assert_reserved`).
"""

from __future__ import annotations

import pytest

from sharded_exp.compose import compose
from sharded_exp.plan.deepen import CHECK_REL
from tests.helpers.overrides import DEEP

STRATEGIES = ["ddp", "fsdp", "fsdp_grad_op", "oss", "sharded_ddp", "zero1"]


_WHOLE: dict[tuple, dict] = {}
"""Whole-model rows by (overrides, device, strategy, world size): the 8-block model at 8 ranks is
faked whole for the test that composes it from 2 ranks and again for the one from 1 to 64."""


def whole_row(overrides, device: str, name: str, world_size: int) -> dict:
    """One point of the model faked whole: the planner's own row (:func:`model_row`, no
    composition by depth), without the speed columns' traced step, which no test here reads."""
    from sharded_exp.plan import points
    from sharded_exp.plan.depth import shapes_of

    key = (tuple(overrides), device, name, world_size)
    if key not in _WHOLE:
        cfg = compose([*overrides, f"plan.strategies=[{name}]", f"plan.device={device}", "plan.by_depth=false"], "plan")
        _WHOLE[key] = points.model_row(cfg, name, world_size, shapes_of(cfg), device)
    return _WHOLE[key]


def composed_and_whole(overrides, world_sizes, device: str, strategies=STRATEGIES):
    from sharded_exp.plan import points

    cfg = compose([*overrides, f"plan.strategies=[{','.join(strategies)}]", f"plan.device={device}"], "plan")
    composed = points.plan_rows(cfg, list(world_sizes), device)
    whole = [whole_row(overrides, device, name, ws) for name in strategies for ws in world_sizes]
    return composed, whole


SHARE_RANGE = (-0.10, 0.35)
"""Where a composed plan's reserved memory may lie against the whole model's where the deeper
shallow fake's share of the peak is kept (an approximation, not the allocator's rules): where
a drawing fails its check, also a block or two deeper, or the traces do not align. ZeRO-1 at
8 ranks and OSS at 2 and 8, whose shards are dealt out whole, kept it until the check was
moved deeper and dealt tensors were no longer grown (ZeRO-1 +20%, OSS +16% to +30%; now
drawn, within 2%); mostly above, the safe side for ``fits``."""


def assert_reserved(composed: dict, whole: dict, point) -> None:
    """Where the allocator model is replayed over the trace drawn to full depth
    (sharded_exp/plan/deepen.py), within the 5% its own check accepts one block deeper
    (measured: DDP 0%, FSDP at 1 rank +3.0% and 0% at 2 and 8, fsdp_grad_op at 2 -3.1%, ZeRO-1
    +1.3% at 2 and +0.7% at 8, OSS +0.5% at 2 and +1.6% at 8); else :data:`SHARE_RANGE`."""
    c, w = composed["reserved_gib"], whole["reserved_gib"]
    if "reserved: replayed over the trace drawn" in composed["note"]:
        assert c == pytest.approx(w, rel=CHECK_REL), ("reserved, drawn", point)
    else:
        low, high = SHARE_RANGE
        assert w * (1 + low) <= c <= w * (1 + high), ("reserved, the share", c, w, point)


def assert_agree(composed, whole) -> None:
    for c, w in zip(composed, whole):
        point = (c["strategy"], c["world_size"], c["method"], c["note"])
        assert (c["strategy"], c["world_size"]) == (w["strategy"], w["world_size"])
        assert not w["method"].startswith("composed")
        assert c["total_gib"] == pytest.approx(w["total_gib"], rel=0.01), point
        assert c["mean_gib"] == pytest.approx(w["mean_gib"], rel=0.01), point
        for part in ("params_gib", "optimizer_gib", "activations_gib"):  # the breakdown follows
            assert c[part] == pytest.approx(w[part], rel=0.01, abs=1e-6), (part, point)
        if w.get("reserved_gib") is not None:
            assert_reserved(c, w, point)


@pytest.mark.parametrize("strategies", [
    ["ddp"], pytest.param(["zero1"], marks=pytest.mark.slow), pytest.param(["fsdp"], marks=pytest.mark.slow),
    pytest.param(["fsdp_grad_op", "oss", "sharded_ddp"], marks=pytest.mark.slow),
], ids=["ddp", "zero1", "fsdp", "the-others"])  # fmt: skip
# ddp in the default tier: a composition checked at 2 ranks and reused at 8 (each strategy's
# whole fake at 8 ranks costs about as much again; the rest, redrawn or dealt lumpy: the slow tier)
def test_the_8_block_model_composed_equals_it_faked_whole(strategies):
    """CUDA's kernels (foreach Adam: the step's temporaries follow the state), 2 and 8 ranks:
    the first world size checks the lines, the second reuses (DDP), redraws (FSDP) or deals
    lumpy shards (ZeRO-1) by the analytic states."""
    composed, whole = composed_and_whole(DEEP, [2, 8], "cuda", strategies)
    assert_agree(composed, whole)
    by = {(r["strategy"], r["world_size"]): r for r in composed}
    # drawn by depth, not faked whole, wherever the lines hold
    for name in {"ddp", "fsdp", "zero1"} & set(strategies):
        assert by[name, 2]["method"].startswith("composed by depth"), by[name, 2]
        assert by[name, 8]["method"].startswith("composed by depth"), by[name, 8]
    if "ddp" in strategies:
        assert "unchanged at 1 blocks" in by["ddp", 8]["note"]  # DDP's lines do not move with the world size
        # its reserved memory replayed over the trace drawn to full depth (held within 5% above),
        # at 8 ranks from the two deeper depths faked there for the allocator's trace alone
        for ws in (2, 8):
            assert "reserved: replayed over the trace drawn" in by["ddp", ws]["note"], by["ddp", ws]["note"]
    # whole tensors dealt out to ranks: the largest rank, and the tensors it steps, move with the
    # depth; drawn all the same (the check a block or two deeper where the shallowest fail it)
    for name in {"zero1", "oss"} & set(strategies):
        for ws in (2, 8):
            assert "reserved: replayed over the trace drawn" in by[name, ws]["note"], by[name, ws]["note"]
    if "fsdp" in strategies:
        assert "redrawn at 8 ranks" in by["fsdp", 8]["note"]  # FSDP's do (the gradients mid-backward)
        # its prefetched units drawn a block apart (sharded_exp/plan/deepen.py), not piled up
        for ws in (2, 8):
            assert "reserved: replayed over the trace drawn" in by["fsdp", ws]["note"], by["fsdp", ws]["note"]


@pytest.mark.slow
def test_a_share_of_the_peak_close_under_the_device_is_settled_by_the_model_faked_whole():
    """ShardedDDP's traces do not align block by block (its reduces and frees move with the
    depth), so its reserved memory is the shallow fake's share of the peak, which may be under
    the whole model's (6.7% on a 7B GPT at 64 ranks). Planned on a device 5% over that share's
    device total, the row is faked whole before ``fits`` answers: its figures are the whole
    model's, and its note says why."""
    from sharded_exp.plan import points

    overrides = [*DEEP, "plan.strategies=[sharded_ddp]", "plan.device=cuda"]
    (shared,) = points.plan_rows(compose(overrides, "plan"), [1], "cuda")  # composed at 1 rank (at 2, 8: whole)
    assert shared["method"].startswith("composed by depth") and "share of the peak" in shared["note"], shared
    budget = shared["device_total_gib"] * 1.05
    (settled,) = points.plan_rows(compose([*overrides, f"plan.device_memory_gib={budget}"], "plan"), [1], "cuda")
    whole = whole_row(DEEP, "cuda", "sharded_ddp", 1)
    assert points.SETTLED in settled["note"] and not settled["method"].startswith("composed"), settled
    for key in ("total_gib", "allocated_gib", "reserved_gib", "device_total_gib"):
        assert settled[key] == pytest.approx(whole[key], rel=1e-9), key
    assert settled["fits"] is (whole["device_total_gib"] <= budget)


@pytest.mark.slow
def test_composed_equals_whole_from_1_to_64_ranks():
    """Every strategy at 1, 8 and 64 ranks on CUDA's kernels (2 ranks: the 8-block test above;
    CPU's kernels: test_plan.py's deep models at 4 ranks, within 1e-6)."""
    composed, whole = composed_and_whole(DEEP, [1, 8, 64], "cuda")
    assert_agree(composed, whole)


@pytest.mark.slow
def test_a_hugging_face_model_composed_equals_it_faked_whole():
    model = ["model=hf_llama", "model.config.num_hidden_layers=7", "model.seq_len=16", "trainer.batch_size=2"]
    composed, whole = composed_and_whole(model, [2, 8], "cuda")
    assert_agree(composed, whole)
    assert any(r["method"].startswith("composed") for r in composed)
