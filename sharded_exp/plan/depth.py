"""The peak of a deep model, composed from fake steps of shallow copies of it.

A fake step costs in proportion to the model's ops, so faking a 7B GPT's 32 blocks (or a
65B's 80) at every strategy and world size would take minutes. Every block of such a model
is the same unit, and each part of each phase's peak (the forward/backward, the optimizer
step) is one of three kinds:

- **model states** the faked rank holds (parameters, gradients, optimizer state): known
  exactly at any depth and world size from the analytic memory model
  (:mod:`sharded_exp.predict.memory_model`), lumpy where whole tensors are dealt out to
  ranks (OSS, ZeRO-1, ShardedDDP). What the step holds beyond them (the gradients not yet
  made mid-backward, the unsharded gradient of the unit in flight) is the same for every
  block, so it lies on a line in depth;
- **the optimizer step's temporaries**, in proportion to the optimizer state the rank
  steps at once (foreach Adam holds ``sqrt(v)`` of every tensor of the parameter group it
  steps), or, for a per-tensor loop, on a line like the rest;
- **the rest** (activations, the gathered unit, buckets, communication): the same for
  every block, so on a line in depth.

A strategy is faked at three shallow depths at the first world size planned: the lines go
through the first two, and the third must lie on them (each part within 0.1%), or the
whole model is faked. At each further world size one shallow fake says whether the lines
moved: where only the shard changed they did not (DDP, OSS, ZeRO-1 under a foreach
optimizer), and the first world size's lines are reused; where they did (FSDP's gradients
mid-backward are part shard, part whole unit; a per-tensor optimizer's temporaries follow
the largest tensor a rank steps), they are drawn and checked anew at that world size. On
CUDA, where the lines are reused, the first world size's allocator drawing is taken where
the strategy's rank holds the same tensors at every world size (DDP) and the shallowest
allocation trace is the first's; else the second depth is faked there too, and where the two
shallowest traces are not the first world size's (the shard's sizes, the largest rank's
tensors) the third as well, for the caching allocator's trace alone
(:func:`_allocator_three`, :func:`drawn_allocator`); where they are, the first world size's
drawing is taken. The peak at full depth is the analytic states at
full depth plus the lines drawn there; every rank's peak follows from the faked rank's
(:func:`~sharded_exp.predict.prediction.peaks_of_ranks`).

``tests/integration/test_plan_compose.py`` holds the composed peaks within 1% of whole-model fake steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import OmegaConf

from sharded_exp.config import JobGroups
from sharded_exp.plan import deepen
from sharded_exp.precision import Precision
from sharded_exp.predict.alloc_trace import point_figures
from sharded_exp.predict.memory_model import largest_group_state_mib
from sharded_exp.predict.prediction import model_shapes, peaks_of_ranks, predict, predict_peak
from sharded_exp.strategies import memory_of
from sharded_exp.vocabulary.memory import MODEL_STATES, OPTIMIZER_STEP

STATES = MODEL_STATES
STEP_TEMPORARIES = OPTIMIZER_STEP
"""The breakdown's part for the optimizer step's temporaries (apart from the state)."""
REL, ABS = 1e-3, 1e-3
"""A line holds where the third depth's part is within REL of it plus ABS MiB."""


@dataclass
class Fake:
    """One fake step of the model cut to ``depth`` blocks, split into its kinds."""

    depth: int
    lines: dict[str, dict[str, float]]
    """phase -> part -> MiB to draw on a line in depth (a state part: what the step holds
    beyond the rank's state)."""
    ratios: dict[str, float | None]
    """phase -> the optimizer step's temporaries per MiB of the rank's optimizer state."""
    raw: dict[str, dict[str, float]]
    """phase -> part -> MiB as faked (the scale of the checks)."""
    seconds: float
    note: str = ""
    """What the fake step says of itself (clipping faked without, a rule applied)."""
    setup_clear: bool = True
    """Whether the strategy's set-up moment (:meth:`MemoryModel.setup_transient_mib`) is clear
    of the peak (:func:`_setup_clear`)."""
    allocator: dict | None = None
    """CUDA: the caching allocator's figures at this depth, replayed from :attr:`trace` when
    first asked (:meth:`figures`): most shallow fakes' never are."""
    trace: tuple | None = None
    """CUDA: what the allocator is asked: (events, allocator setting, cuBLAS workspace MiB)."""

    def figures(self) -> dict | None:
        """:attr:`allocator`, replayed from :attr:`trace` if not yet
        (:func:`~sharded_exp.predict.alloc_trace.point_figures`); None on CPU."""
        if self.allocator is None and self.trace is not None:
            self.allocator = point_figures(*self.trace)
        return self.allocator


_SHAPES: dict[str, Any] = {}


def shapes_of(cfg: JobGroups):
    """The configured model's shapes (:func:`~sharded_exp.predict.prediction.model_shapes`),
    built once per model, optimizer and freeze config: a plan asks for the same ones for
    every strategy and world size (a 7B model on the meta device takes most of a second)."""
    key = OmegaConf.to_yaml(OmegaConf.create({"m": cfg.model, "o": cfg.optimizer, "f": cfg.trainer.freeze}))
    if key not in _SHAPES:
        _SHAPES[key] = model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze)
    return _SHAPES[key]


def first_depth(name: str) -> int:
    """The shallowest depth whose peak lies on the model's line under strategy ``name``."""
    return memory_of(name).depth_line_from


def fake_at(cfg_s, key: str, depth: int, world_size: int, device_type: str) -> Fake | str:
    """A fake step of ``cfg_s``'s model cut to ``depth`` blocks, or why there is none."""
    c = cfg_s.copy()
    OmegaConf.update(c.model, key, depth)
    shapes = shapes_of(c)
    prediction = predict(c.strategy, c.optimizer, Precision.of(c), shapes, world_size)
    peak = predict_peak(c, world_size, device_type, prediction, shapes, flops=False, keep_trace=True)
    if peak["per_rank_mib"] is None:
        return peak["error"]
    mine = prediction["model_states_mib"][peak["rank"]]
    stepped = _stepped_state(c, shapes, world_size, peak["rank"])
    lines, ratios, raw = {}, {}, {}
    for phase, (_, parts) in peak["phases_mib"].items():
        raw[phase] = dict(parts)
        lines[phase] = {k: v - mine[k] if k in STATES else v for k, v in parts.items()}
        temporaries = parts.get(STEP_TEMPORARIES, 0.0)
        ratios[phase] = temporaries / stepped if stepped > 0 else None
    clear = _setup_clear(c, shapes, world_size, mine, {k: p for k, (p, _) in peak["phases_mib"].items()})
    return Fake(
        depth, lines, ratios, raw, peak["seconds"] or 0.0, peak["note"], clear, None, peak.get("alloc_trace"),
    )  # fmt: skip


def _setup_clear(cfg_s, shapes, world_size: int, mine: dict[str, float], peaks: dict[str, float]) -> bool:
    """Whether the strategy's set-up moment (in the first forward: the "step" phase), with
    every state the rank holds, stays below that phase's peak: then it is not the peak."""
    transient = memory_of(cfg_s.strategy.name).setup_transient_mib(cfg_s.strategy, shapes, world_size)
    return not transient or sum(mine.values()) + transient < peaks.get("step", max(peaks.values()))


def _stepped_state(cfg_s, shapes, world_size: int, rank: int) -> float:
    """The optimizer state ``rank`` steps at once (MiB): its largest parameter group's."""
    return largest_group_state_mib(
        memory_of(cfg_s.strategy.name),
        cfg_s.strategy,
        cfg_s.optimizer,
        shapes.groups,
        world_size,
        rank,
        shapes.element_bytes,
    )


def _near(value: float, expected: float, scale: float) -> bool:
    return abs(value - expected) <= REL * abs(scale) + ABS


def _ratio_holds(fakes: list[Fake], phase: str) -> bool:
    ratios = [f.ratios.get(phase) for f in fakes]
    return None not in ratios and all(abs(r - ratios[0]) <= REL * abs(ratios[0]) + 1e-9 for r in ratios)


def rules_on_line(a: Fake, b: Fake, c: Fake) -> dict[str, str] | None:
    """Whether ``c`` lies on the lines through ``a`` and ``b`` (depths one apart). Returns how each
    phase's optimizer-step temporaries grow (``ratio``: with the rank's optimizer state,
    as a foreach optimizer's do; ``line``: like the rest, as a per-tensor loop's largest
    tensor does), or None where anything bends."""
    if not a.lines.keys() == b.lines.keys() == c.lines.keys():
        return None
    steps = (c.depth - b.depth) / (b.depth - a.depth)
    rules = {}
    for phase, line in c.lines.items():
        at = lambda f, k: f.lines[phase].get(k, 0.0)  # noqa: E731
        bent = {
            k for k, v in line.items() if not _near(v, at(b, k) + steps * (at(b, k) - at(a, k)), c.raw[phase].get(k, v))
        }
        if _ratio_holds([a, b, c], phase):
            rules[phase] = "ratio"
            bent.discard(STEP_TEMPORARIES)
        else:
            rules[phase] = "line"
        if bent:
            return None
    return rules


def same_lines(a: Fake, b: Fake, rules: dict[str, str]) -> bool:
    """Whether two fakes at one depth (two world sizes) have the same lines."""
    if a.lines.keys() != b.lines.keys():
        return False
    for phase, line in b.lines.items():
        for k, v in line.items():
            if k == STEP_TEMPORARIES and rules.get(phase) == "ratio":
                if not _ratio_holds([a, b], phase):
                    return False
            elif not _near(v, a.lines[phase].get(k, 0.0), b.raw[phase].get(k, v)):
                return False
    return True


def compose(a: Fake, b: Fake, layers: int, prediction: dict[str, Any], rules, stepped: float):
    """Each phase's peak at ``layers`` blocks: the lines through ``a`` and ``b`` drawn there,
    on top of the largest rank's analytic states at that depth (``stepped``: the optimizer
    state it steps at once)."""
    states = prediction["model_states_mib"]
    mine = max(states, key=lambda s: sum(s.values()))
    steps = (layers - b.depth) / (b.depth - a.depth)
    phases = {}
    for phase, line in b.lines.items():
        parts = {k: v + steps * (v - a.lines[phase].get(k, 0.0)) for k, v in line.items()}
        for k in STATES:
            parts[k] = parts.get(k, 0.0) + mine[k]
        if rules.get(phase) == "ratio":
            parts[STEP_TEMPORARIES] = b.ratios[phase] * stepped
        parts = {k: max(0.0, v) for k, v in parts.items()}
        phases[phase] = (sum(parts.values()), parts)
    return phases


ALLOCATOR_SHARES = ("allocated_extra_mib", "reserved_extra_mib", "fragmentation_mib")
"""The allocator's figures :func:`compose_allocator` scales with the peak where no trace is drawn."""


def compose_allocator(b: Fake, peak_mib: float) -> dict | None:
    """The caching allocator's figures at full depth (``peak_mib``: the composed peak) where no
    full-depth trace could be drawn (:func:`drawn_allocator`): the deeper shallow fake's, each in
    the same proportion to the peak as there. This mostly overstates reserved memory (the cache
    grows with depth less than the peak does: +5% to +15% on a 24-block GPT), but not always
    (ShardedDDP on a 7B GPT at 64 ranks: 6.7% under the model faked whole, its cache growing
    with depth more than its peak), so it is said in the figures' ``depth`` note and marked
    ``share_of_peak``: a row it says fits close under the device's memory is faked whole
    (:func:`~sharded_exp.plan.points.settled_whole`). None on CPU."""
    figures = b.figures()
    if figures is None or not figures.get("tracked_peak_mib"):
        return None
    scale = peak_mib / figures["tracked_peak_mib"]
    return {
        **figures,
        **{k: figures[k] * scale for k in ALLOCATOR_SHARES},
        "depth": "the deeper shallow fake's share of the peak (its trace not drawn to full depth)",
        "share_of_peak": True,
    }


DEEPER_CHECKS = 2
"""How many times :func:`drawn_allocator` fakes one block deeper where the drawing fails its
check at the shallowest three depths. A strategy that deals whole tensors to ranks (ZeRO-1,
OSS) fakes its largest rank, and which rank that is, and which tensors it steps, moves with
the depth: at 8 ranks the one-block model's 16 tensors give each rank two, and the step's
foreach temporaries of the rank faked at 3 blocks (4 x 192 KiB) are not those drawn from 1 and
2 (2 x 256 KiB; one 2 MiB segment fewer: 1.6 MiB off where 5% of 28 is 1.4). Deeper, each
rank's share is more tensors, one tensor more or less moves the cache less, and the same
check passes from 3, 4 and 5 blocks (ZeRO-1 at 8 ranks, OSS at 2 on the 8-block test model).
Each check is as strict as the first; a fake at a few blocks costs far less than the whole
model's. A drawing by runs in place is also checked on a fake one block deeper than the third
(:func:`~sharded_exp.plan.deepen.drawn_to`), the next try's third where that check fails: at
most one more fake than this in all (asked also where runs in place fail the first check, for
whole blocks with the frees in one order: on the last try that is a fake the loop would not
have made). Where no two of the three traces align block by block
(ShardedDDP on a 7B GPT, at every depth from 1 to 5), no deeper fake is made: the share of the
peak is kept at once."""


def drawn_allocator(fakes: list[Fake], layers: int, deeper: Callable[[int], Fake | str] | None = None) -> dict | None:
    """The caching allocator's figures at ``layers`` blocks from its model replayed over the
    trace drawn to that depth from three shallow fakes' (:mod:`sharded_exp.plan.deepen`),
    checked on the third (and on a fake one block deeper, from ``deeper``, where the drawing
    repeats runs in place); where that check fails, ``deeper`` (a fake at the given depth)
    moves the three one block deeper, at most :data:`DEEPER_CHECKS` times while short of
    ``layers``, unless no two of the three traces align block by block
    (:func:`~sharded_exp.plan.deepen.aligns`). None where nothing could be drawn (the plan then
    keeps the share of the peak: :func:`compose_allocator`)."""
    made: dict[int, Fake | str] = {}

    def fake(depth: int) -> Fake | str:  # each depth faked once: a check's fake is the next try's third
        if depth not in made:
            made[depth] = deeper(depth) if deeper is not None else "no deeper fake"
        return made[depth]

    three = list(fakes)
    for tries in range(DEEPER_CHECKS + 1):
        if tries:
            if three[2].depth + 1 >= layers or not deepen.aligns(*(f.trace[0] for f in three)):
                return None
            more = fake(three[2].depth + 1)
            if not isinstance(more, Fake):
                return None
            three = [*three[1:], more]
        a, b, c = three
        if any(f.trace is None for f in three):
            return None
        events, alloc_conf, workspace = c.trace

        def one_deeper(c=c) -> list | None:
            d = fake(c.depth + 1) if c.depth + 1 < layers else None
            return d.trace[0] if isinstance(d, Fake) and d.trace is not None else None

        drawn = deepen.drawn_to(a.trace[0], b.trace[0], events, layers - c.depth, alloc_conf, one_deeper)
        if drawn is not None:
            figures = point_figures(drawn, alloc_conf, workspace)
            if figures is not None:
                figures["depth"] = (
                    f"replayed over the trace drawn to {layers} blocks from {a.depth}, {b.depth} and {c.depth}"
                )
            return figures
    return None


def _allocator_three(
    fakes: list, first_three: list[Fake], fake: Callable[[int], Fake | str], by_world_size: bool = True
) -> list | None:
    """The three shallow fakes the allocator's trace is drawn from at a world size whose lines
    are the first world size's, ``fakes`` holding its shallowest fake (the deeper ones, made by
    ``fake`` at a depth, are appended). The first world size's three where this one's two
    shallowest traces are theirs (:func:`~sharded_exp.plan.deepen.same_trace`), or its
    shallowest alone where the strategy's rank holds the same tensors at every world size
    (``by_world_size`` False: :attr:`~sharded_exp.strategies.residency.MemoryModel.tensors_by_world_size`,
    DDP's). Else (the shard's sizes, a collective more; ZeRO-1's largest rank holds other
    tensors at 2 blocks of a 7B GPT at 64 ranks than at 8, the same at 1) the lines hold but
    the cache may not: the two deeper fakes here, for the allocator's trace alone. None where a
    fake has no trace (then the share of the peak)."""
    if fakes[0].trace is None:
        return None
    if not by_world_size and deepen.same_trace(first_three[0].trace, fakes[0].trace):
        return first_three
    fakes.append(fake(first_three[1].depth))
    if not isinstance(fakes[1], Fake) or fakes[1].trace is None:
        return None
    if deepen.same_trace(first_three[0].trace, fakes[0].trace) and deepen.same_trace(
        first_three[1].trace, fakes[1].trace
    ):
        return first_three
    fakes.append(fake(first_three[2].depth))
    return fakes if isinstance(fakes[2], Fake) else None


def _drawing(three, first_three, drawn_first: list, layers: int, fake: Callable[[int], Fake | str]):
    """:func:`drawn_allocator` of ``three`` with deeper fakes from ``fake`` (a fake at a depth),
    and the deeper fakes it made; where ``three`` are the first world size's (``first_three``),
    that world size's drawing, made once and kept in ``drawn_first``: the same traces draw the
    same, from the same deeper fakes."""
    if three is not None and three is first_three and drawn_first:
        return drawn_first[0], []
    made: list[Fake] = []  # deeper fakes for the allocator's check alone (DEEPER_CHECKS)

    def deeper(depth: int) -> Fake | str:
        more = fake(depth)
        made.extend([more] if isinstance(more, Fake) else [])
        return more

    drawn = drawn_allocator(three, layers, deeper) if three else None
    if three is not None and three is first_three:
        drawn_first.append(drawn)
    return drawn, made


def peaks_by_depth(cfg_s, world_sizes, device_type: str, key: str, layers: int) -> dict[int, dict | None]:
    """The composed peak (as :func:`~sharded_exp.predict.prediction.predict_peak` returns
    one) of ``cfg_s`` at each world size; None where the model cannot be drawn by depth
    (a line bends, a shallow fake fails): the caller fakes the whole model there."""
    name = cfg_s.strategy.name
    strategy = memory_of(name)  # its memory model: whether its lines move with the world size
    d0 = first_depth(name)
    depths = (d0, d0 + 1, d0 + 2)
    out: dict[int, dict | None] = {}
    first: tuple[Fake, Fake] | None = None
    first_three: list[Fake] = []
    drawn_first: list[dict | None] = []  # what the allocator's trace drawn from first_three gave
    first_ws, rules = 0, {}
    full_shapes = shapes_of(cfg_s)
    for ws in world_sizes:
        fakes = [fake_at(cfg_s, key, depths[0], ws, device_type)]
        reuse = first is not None and not strategy.depth_lines_per_world_size and isinstance(fakes[0], Fake)
        if reuse and same_lines(first[0], fakes[0], rules):
            pair, here = first, rules
            how = f"as at {first_ws} ranks: unchanged at {depths[0]} blocks"
            at = lambda d, ws=ws: fake_at(cfg_s, key, d, ws, device_type)  # noqa: E731
            three = _allocator_three(fakes, first_three, at, strategy.tensors_by_world_size)
        else:  # the first world size, or the lines moved: drawn and checked here
            fakes += [fake_at(cfg_s, key, d, ws, device_type) for d in depths[1:]]
            found = None if any(isinstance(f, str) for f in fakes) else rules_on_line(*fakes)
            if found is None:
                out[ws] = None  # faked whole by the caller
                continue
            pair, here, three = (fakes[0], fakes[1]), found, fakes
            how = f"checked at {depths[2]}" if first is None else f"redrawn at {ws} ranks, checked at {depths[2]}"
            if first is None:
                first, first_ws, rules, first_three = pair, ws, found, fakes
        prediction = predict(cfg_s.strategy, cfg_s.optimizer, Precision.of(cfg_s), full_shapes, ws)
        states = prediction["model_states_mib"]
        rank = max(range(len(states)), key=lambda r: sum(states[r].values()))
        phases = compose(*pair, layers, prediction, here, _stepped_state(cfg_s, full_shapes, ws, rank))
        peaks = {k: p for k, (p, _) in phases.items()}
        if not all(f.setup_clear for f in pair) or not _setup_clear(cfg_s, full_shapes, ws, states[rank], peaks):
            out[ws] = None  # the strategy's set-up moment may be the peak: faked whole
            continue
        top = max(phases.values(), key=lambda p: p[0])
        at = lambda depth, ws=ws: fake_at(cfg_s, key, depth, ws, device_type)  # noqa: E731
        drawn, made = _drawing(three, first_three, drawn_first, layers, at)
        if drawn is not None and three is first_three and ws != first_ws:
            why = (
                "the same shallow traces" if strategy.tensors_by_world_size else "the same tensors at every world size"
            )
            drawn = {**drawn, "depth": f"{drawn['depth']} (as at {first_ws} ranks: {why})"}
        allocator = drawn or compose_allocator((three or pair)[1], top[0])
        fakes = fakes + made  # a new list: the first world size's three are kept as they are
        out[ws] = {
            "per_rank_mib": peaks_of_ranks(list(phases.values()), states, rank),
            "rank": rank,
            "breakdown_mib": top[1],
            "phases_mib": phases,
            "method": f"composed by depth: fake steps at {', '.join(map(str, depths))} blocks, drawn to the model's depth",
            "note": "; ".join(
                n
                for n in (
                    f"{key}={layers}: drawn from {pair[0].depth} and {pair[1].depth} blocks ({how})",
                    pair[1].note,
                    allocator and f"reserved: {allocator['depth']}",
                )
                if n
            ),
            "allocator": allocator,
            "seconds": sum(f.seconds for f in fakes if isinstance(f, Fake)),
            "fakes": len(fakes),
        }
    return out
