"""``result.json``: one file per job, the single source for tables, reports and W&B."""

from __future__ import annotations

import math
import statistics
from typing import Any

from sharded_exp.job.result import PartialResult, Result
from sharded_exp.output import TERMINAL_WIDTH


def base_result(
    cfg_data: dict[str, Any],
    params: int | None,
    output_dir: str,
    status: str = "running",
    error: str | None = None,
    **fields: Any,
) -> Result:
    """What a job is, before it runs (``fields``: more of :class:`Result`'s, its place in a sweep)."""
    t = cfg_data["trainer"]
    return Result.build(
        status=status,
        error=error,
        strategy=cfg_data["strategy"]["name"],
        precision=str(cfg_data["precision"]["name"]),
        model=cfg_data["model"]["name"],
        optimizer=cfg_data["optimizer"]["name"],
        world_size=t["world_size"],
        accelerator=t["accelerator"],
        params=params,
        steps=t["steps"],
        output_dir=output_dir,
        config=cfg_data,
        **fields,
    )


def training_result(
    out,
    per_rank: list[dict[str, Any]],
    digest: dict[str, float],
    final_loss: float,
    *,
    start: int,
    world_size: int,
    resumed_from: str | None,
    resume_changes: list[dict[str, Any]],
    params: int,
    signal: int | None,
    memory: dict[str, Any],
    timeline: dict[str, float],
    device: dict[str, Any] | None = None,
) -> PartialResult:
    """What rank 0 sends the parent when training ended: result.json's training part,
    which the parent lays over :func:`base_result`. ``out``: the trainer's LoopOutcome."""
    nonfinite = [e.get("first_nonfinite_step", -1) for e in per_rank if e.get("first_nonfinite_step", -1) >= 0]
    diverged = not math.isfinite(final_loss) or any(e["nonfinite_params"] for e in per_rank)
    return PartialResult.build(
        status="stopped" if out.stopped else ("diverged" if diverged else "ok"),
        error=_divergence(final_loss, per_rank, nonfinite) if diverged else None,
        first_nonfinite_step=min(nonfinite) if nonfinite else None,
        signal=signal if out.stopped else None,
        start_step=start,
        steps_done=out.steps_done,
        world_size=world_size,
        resumed_from=resumed_from,
        resume_changes=resume_changes,
        checkpoint=out.checkpoint,
        params=params,
        final_loss=final_loss,
        final_metrics=out.history[-1],
        param_digest=digest,
        throughput=out.throughput,
        history=out.history,
        eval=_eval_section(out.evals),
        memory=memory,
        profile=profile_section(per_rank, out.throughput),
        timeline={**timeline, "first_step": out.first_step_unix, "last_step": out.last_step_unix},
        device=device,  # what ran it, where ``accelerator`` says what was asked for
    )


def finished_result(result: Result, payload: PartialResult | None, parent_times: dict[str, float | None]) -> Result:
    """The result of a job whose ranks ended: :func:`base_result` with rank 0's
    :func:`training_result` laid over it (None: a torchrun rank other than 0, status "ok"),
    and one timeline in Unix times: main -> imported -> launch -> validated (the parent's),
    then rank_start -> process_group_ready -> built -> first_step -> last_step (rank 0's),
    with logger_ready (the tracker started, beside the first steps) after built. Also
    ``throughput.first_step_after_start_s``: main to first_step, the start-up as one figure."""
    payload = payload or PartialResult.build(status="ok")
    timeline = {**parent_times, **(payload.timeline or {})}
    done = result.updated(**payload.as_written()).updated(timeline=timeline)
    start, first = timeline.get("main"), timeline.get("first_step")
    throughput = payload.as_written().get("throughput")
    if start is None or first is None or throughput is None:
        return done
    # the start-up a user waits through, as one figure (benchmarks/harness/startup.py splits it)
    return done.updated(throughput={**throughput, "first_step_after_start_s": first - start})


def _eval_section(evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not evals:
        return None
    return {
        "final": {k: v for k, v in evals[-1].items() if k.startswith("eval/")},
        "history": [{k: v for k, v in e.items() if k != "seconds"} for e in evals],
        "seconds": sum(e["seconds"] for e in evals),  # every pass, untimed by the steps
    }


def _divergence(final_loss: float, per_rank: list[dict[str, Any]], nonfinite: list[int]) -> str:
    """One line saying how a run diverged (result.json's error for status "diverged")."""
    bad = [e["rank"] for e in per_rank if e["nonfinite_params"]]
    where = f"loss first non-finite at step {min(nonfinite)}" if nonfinite else "loss finite at every step"
    params = f"non-finite parameters on rank(s) {', '.join(map(str, bad))}" if bad else "parameters finite"
    return f"diverged: final loss {final_loss}, {where}, {params}"


def format_table(
    rows: list[list[str]], header: list[str], width: int | None = None, groups: list[int] | None = None
) -> str:
    """Right-aligned columns, two spaces apart. ``width``: the columns are folded into blocks
    of at most that many characters a line, one under the other (a blank line between), each
    with its own headings, so that no column is left out and no line wraps. ``groups``: the
    number of columns in each group, in order (default: one group); a group is kept in one
    block where it fits, and a block takes the next group whole only if it still fits."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    limit = width if width is not None else sum(w + 2 for w in widths)
    starts = [sum((groups or [len(header)])[:k]) for k in range(len(groups or [len(header)]) + 1)]
    blocks: list[list[int]] = [[]]
    size = lambda columns: sum(widths[i] + 2 for i in columns) - 2  # noqa: E731
    for a, b in zip(starts, starts[1:]):
        if blocks[-1] and size(blocks[-1] + list(range(a, b))) > limit:
            blocks.append([])
        for i in range(a, b):  # a group wider than the limit is folded column by column
            if blocks[-1] and size([*blocks[-1], i]) > limit:
                blocks.append([])
            blocks[-1].append(i)
    line = lambda cells, block: "  ".join(str(cells[i]).rjust(widths[i]) for i in block)  # noqa: E731
    dashes = ["-" * w for w in widths]
    return "\n\n".join("\n".join([line(header, b), line(dashes, b)] + [line(r, b) for r in rows]) for b in blocks)


def _eval_cell(result: Result) -> str:
    """The final evaluation in short, with what its passes cost: ``acc 0.91 f1 0.88 (0.21 s)``."""
    if result.eval is None:
        return "-"
    final = result.eval.final
    short = {"eval/accuracy": "acc", "eval/f1": "f1", "eval/perplexity": "ppl"}
    cells = [f"{name} {final[key]:.3g}" for key, name in short.items() if key in final]
    if cells:
        cells.append(f"({result.eval.seconds:.2f} s)")
    return " ".join(cells) or "-"


def summary_table(result: Result) -> str:
    """The short end-of-run table printed by the parent: the run, its speed and its memory,
    folded to fit the terminal (:data:`~sharded_exp.output.TERMINAL_WIDTH`); result.json
    holds every figure."""
    tp, mem = result.throughput, result.memory
    mib = lambda key: f"{getattr(mem, key):.2f}" if mem is not None and getattr(mem, key, None) is not None else "-"  # noqa: E731
    timed = tp is not None and bool(tp.model_dump(exclude_unset=True))  # {} when no step was timed
    run = {
        "strategy": result.strategy,
        "precision": result.precision,
        "world_size": result.world_size,
        "model": result.model,
        "params": f"{result.params:,}",
        "final_loss": f"{result.final_loss:.4f}" if result.final_loss is not None else "-",
        "eval": _eval_cell(result),
        "status": result.status,
    }
    speed = {
        "samples/s": f"{tp.samples_per_s:.1f}" if timed else "-",
        "step_ms": f"{1000 * tp.step_time_s_median:.1f}" if timed else "-",
        "pred_step_ms": f"{1000 * tp.predicted_step_time_s:.1f}"
        if timed and tp.predicted_step_time_s is not None
        else "-",
        "mfu_pct": f"{tp.mfu_pct:.1f}" if tp is not None and tp.mfu_pct is not None else "-",
    }
    memory = {
        "peak_MiB": mib("peak_allocated_mib_max"),
        "peak_mean_MiB": mib("peak_allocated_mib_mean"),
        "pred_peak_MiB": mib("predicted_peak_mib_max"),
    }
    if mem is not None and (mem.peak_reserved_mib_max is not None or mem.predicted_peak_reserved_mib_max is not None):
        # CUDA: the caching allocator's reserved bytes, measured and predicted (a CPU run has none)
        memory |= {
            "reserved_MiB": mib("peak_reserved_mib_max"),
            "pred_reserved_MiB": mib("predicted_peak_reserved_mib_max"),
        }
    memory |= {"states_MiB": mib("model_states_mib_max"), "pred_states_MiB": mib("predicted_model_states_mib_max")}
    groups = [run, speed, memory]
    header = [k for g in groups for k in g]
    row = [v for g in groups for v in g.values()]
    return format_table([row], header, width=TERMINAL_WIDTH, groups=[len(g) for g in groups])


# ------------------------------------------------ result.json's memory section
def _peak_summary(peak: dict[str, Any] | None) -> dict[str, Any] | None:
    if not peak:
        return None
    return {
        k: peak.get(k)
        for k in (
            "method",
            "note",
            "rank",
            "breakdown_mib",
            "build_peak_mib",
            "build_breakdown_mib",
            "kernels",
            "rules",
            "host_mib",
            "host_breakdown_mib",
            "allocator",
            "seconds",
            "error",
        )
    }


def predicted_reserved(prediction: dict[str, Any]) -> tuple[list[float] | None, str | None]:
    """Each rank's predicted peak reserved bytes (MiB) on CUDA: its predicted peak plus what the
    caching allocator's model adds to the faked rank's (sharded_exp.predict.alloc_trace); or
    None and why (CPU: no caching allocator)."""
    peak = prediction.get("peak") or {}
    peaks = peak.get("per_rank_mib")
    if not peaks:
        return None, "no predicted peak: " + (peak.get("error") or "nothing was faked")
    allocator = peak.get("allocator")
    if allocator is None:
        kernels = str(peak.get("kernels") or "")
        if kernels.startswith("cuda"):
            return None, "the caching allocator was not modelled (backend:cudaMallocAsync, or no fake step's trace)"
        return None, "a CPU run has no caching allocator: nothing is reserved beyond the tensors"
    return [p + allocator["reserved_extra_mib"] for p in peaks], None


def predicted_section(prediction: dict[str, Any], limit_applies_to: str | None = None) -> dict[str, Any]:
    """result.json's ``memory`` before the ranks start (and of a run that ended without
    measuring, an OOM one): the prediction alone, same names."""
    peaks = (prediction.get("peak") or {}).get("per_rank_mib")
    per_rank = [{"rank": r, "predicted_model_states_mib": p} for r, p in enumerate(prediction["model_states_mib"])]
    if peaks:
        for entry, peak in zip(per_rank, peaks):
            entry["predicted_peak_mib"] = peak
    reserved, why = predicted_reserved(prediction)
    for entry, value in zip(per_rank, reserved or []):
        entry["predicted_peak_reserved_mib"] = value
    return {
        "per_rank": per_rank,
        "predicted_model_states_mib_max": max(sum(p.values()) for p in prediction["model_states_mib"]),
        "predicted_transient_params_mib": prediction["transient_params_mib"],
        "predicted_peak_mib_max": max(peaks) if peaks else None,
        "predicted_peak_mib_mean": sum(peaks) / len(peaks) if peaks else None,
        "predicted_peak_reserved_mib_max": max(reserved) if reserved else None,
        "predicted_peak_reserved_error": why,
        "peak_prediction": _peak_summary(prediction.get("peak")),
        "memory_limit_applies_to": limit_applies_to,
    }


def _largest(per_rank: list[dict[str, Any]]):
    def largest(key):
        values = [r[key] for r in per_rank if r.get(key) is not None]
        return max(values) if values else None

    return largest


def _average(per_rank: list[dict[str, Any]]):
    def average(key):  # over every rank, or None when a rank has no figure
        values = [r.get(key) for r in per_rank]
        return sum(values) / len(values) if values and all(v is not None for v in values) else None

    return average


def _band(per_rank: list[dict[str, Any]], key: str):
    """The smallest and the median over ranks (a dashboard's band at 64 ranks)."""
    values = sorted(r[key] for r in per_rank if r.get(key) is not None)
    if not values:
        return None, None
    n = len(values)
    return values[0], values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def largest_and_mean(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures over ranks result.json's ``memory`` holds beside ``per_rank`` (a probe's
    result too): the largest, mean, smallest and median peak, model states, the prediction."""
    largest, average = _largest(per_rank), _average(per_rank)
    peak_min, peak_median = _band(per_rank, "peak_allocated_mib")
    return {
        "peak_allocated_mib_max": largest("peak_allocated_mib"),
        "peak_allocated_mib_mean": average("peak_allocated_mib"),
        "peak_allocated_mib_min": peak_min,
        "peak_allocated_mib_median": peak_median,
        "peak_error": next((f"rank {r['rank']}: {r['peak_error']}" for r in per_rank if r.get("peak_error")), None),
        "model_states_mib_max": max(
            (sum(r["model_states_mib"].values()) for r in per_rank if r.get("model_states_mib")), default=None
        ),
        "predicted_peak_mib_max": largest("predicted_peak_mib"),
        "predicted_peak_mib_mean": average("predicted_peak_mib"),
        "peak_rel_error_max": max(
            (r["peak_rel_error"] for r in per_rank if r.get("peak_rel_error") is not None), key=abs, default=None
        ),
    }


def memory_section(
    prediction: dict[str, Any], per_rank: list[dict[str, Any]], source: str, limit_applies_to: str | None = None
) -> dict[str, Any]:
    """Measured memory per rank beside the prediction: result.json's ``memory``."""
    predicted = prediction["model_states_mib"]
    peaks = (prediction.get("peak") or {}).get("per_rank_mib") or [None] * len(per_rank)
    for entry, pred, peak in zip(per_rank, predicted, peaks):
        entry["predicted_model_states_mib"] = pred
        entry["model_states_rel_error"] = relative_error(pred, entry["model_states_mib"])
        measured = entry.get("peak_allocated_mib")
        entry["predicted_peak_mib"] = peak
        # signed: below zero the prediction was too low (the dangerous direction)
        entry["peak_rel_error"] = (peak - measured) / measured if peak is not None and measured else None
    reserved, why = predicted_reserved(prediction)
    for entry, value in zip(per_rank, reserved or [None] * len(per_rank)):
        entry["predicted_peak_reserved_mib"] = value  # beside the measured peak_reserved_mib (CUDA)

    largest, average = _largest(per_rank), _average(per_rank)
    peak_min, peak_median = _band(per_rank, "peak_allocated_mib")

    # Gathered (unsharded) parameters on top of the resident ones, e.g. FSDP's units.
    measured_transient = [
        r["peak_breakdown_mib"]["Parameter"] - r["model_states_mib"]["params"]
        for r in per_rank
        if r.get("peak_breakdown_mib")
    ]
    return {
        "source": source,
        # what trainer.memory_limit_mib bounded, when one was set: reserved bytes on CUDA, live tensors on CPU
        "memory_limit_applies_to": limit_applies_to,
        "per_rank": per_rank,
        "peak_allocated_mib_max": largest("peak_allocated_mib"),
        # the average over ranks: what the seed study reported (a shard-sized rank and one that
        # holds a whole embedding average out; the maximum is what must fit)
        "peak_allocated_mib_mean": average("peak_allocated_mib"),
        "peak_allocated_mib_min": peak_min,
        "peak_allocated_mib_median": peak_median,
        # Why a rank's peak is null: its tracker could not measure (the run went on).
        "peak_error": next((f"rank {r['rank']}: {r['peak_error']}" for r in per_rank if r.get("peak_error")), None),
        "peak_rss_mib_max": largest("peak_rss_mib"),
        "model_states_mib_max": max(sum(r["model_states_mib"].values()) for r in per_rank),
        "predicted_model_states_mib_max": max(sum(p.values()) for p in predicted),
        "model_states_rel_error_max": largest("model_states_rel_error"),
        "predicted_transient_params_mib": prediction["transient_params_mib"],
        "transient_params_mib_max": max(measured_transient) if measured_transient else None,
        "predicted_peak_mib_max": max(p for p in peaks) if all(p is not None for p in peaks) else None,
        "predicted_peak_mib_mean": average("predicted_peak_mib"),
        "peak_reserved_mib_max": largest("peak_reserved_mib"),
        "predicted_peak_reserved_mib_max": largest("predicted_peak_reserved_mib"),
        "predicted_peak_reserved_error": why,
        "peak_rel_error_max": max(
            (r["peak_rel_error"] for r in per_rank if r["peak_rel_error"] is not None), key=abs, default=None
        ),
        "peak_prediction": _peak_summary(prediction.get("peak")),
        # the build's peak, apart from the training's (a sharded build: shards plus one unit)
        "build_peak_mib_max": largest("build_peak_mib"),
        "predicted_build_peak_mib": (prediction.get("peak") or {}).get("build_peak_mib"),
        "memory_snapshot": snapshot_summary([r["memory_snapshot"] for r in per_rank if r.get("memory_snapshot")]),
    }


# ---------------------------------------------- what an out-of-memory leaves behind
def snapshot_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """result.json's ``memory.memory_snapshot`` from the ranks' own records: whether the CUDA
    allocator's history was recorded (its cost is in the step times), and the files dumped."""
    if not records:
        return None
    files = [r["path"] for r in records if r.get("path")]
    return {
        "setting": records[0]["setting"],
        "recorded": any(r["recorded"] for r in records),
        "files": files,
        "reason": None if files else records[0]["reason"],
    }


def oom_memory(failures: list[dict[str, Any]]) -> dict[str, Any]:
    """result.json's memory fields of a job that ran out of memory, from its ranks' error
    records (earliest first): ``oom_breakdown`` (the CPU tracker's, of the first rank over
    its budget), or null and ``oom_breakdown_error``; ``memory_snapshot`` (CUDA files)."""
    held = [(f["rank"], f["memory_at_oom"]) for f in failures if f.get("memory_at_oom")]
    breakdowns = [{"rank": rank, **at["oom_breakdown"]} for rank, at in held if at.get("oom_breakdown")]
    snapshot = snapshot_summary([at["memory_snapshot"] for _, at in held if at.get("memory_snapshot")])
    if breakdowns:
        reason = None
    elif snapshot and snapshot["files"]:
        reason = "a CUDA run: the allocator's snapshot (memory.memory_snapshot) holds what was live"
    elif snapshot and not (snapshot["reason"] or "").startswith("no CUDA allocator"):
        reason = f"a CUDA run without a snapshot: {snapshot['reason']} (memory.memory_snapshot)"
    elif held:
        reason = "the allocation failed where the CPU tracker kept no record (not over trainer.memory_limit_mib)"
    else:
        reason = "no rank recorded its memory at the failure"
    return {
        "oom_breakdown": breakdowns[0] if breakdowns else None,
        "oom_breakdown_error": reason,
        "memory_snapshot": snapshot,
    }


def profile_section(per_rank: list[dict[str, Any]], throughput: dict[str, Any]) -> dict[str, Any] | None:
    """result.json's ``profile`` (trainer.profile): the traces, and a profiled step's time
    beside the unprofiled (timed) steps' median, both rank 0's."""
    records = [r["profile"] for r in per_rank if r.get("profile")]
    if not records:
        return None
    first = records[0]
    profiled = statistics.median(first["step_time_s"]) if first["step_time_s"] else None
    unprofiled = (throughput or {}).get("step_time_s_median")
    sizes = [r["size_mib"] for r in records if r["size_mib"] is not None]
    return {
        "files": [r["path"] for r in records if r["path"]],
        "steps": first["steps"],
        "size_mib_per_rank": max(sizes) if sizes else None,
        "step_time_s_median": profiled,
        "unprofiled_step_time_s_median": unprofiled,
        "cost_ratio": profiled / unprofiled if profiled and unprofiled else None,
        "export_s": max((r["export_s"] for r in records if r["export_s"] is not None), default=None),
        "note": first["note"],
        "error": next((f"rank {i}: {r['error']}" for i, r in enumerate(records) if r["error"]), None),
    }


def memory_lines(result: Result) -> list[str]:
    """Lines printed under the summary table: the out-of-memory breakdown, the snapshot
    files, the profiler's traces."""
    lines = []
    mem = result.memory
    oom = mem.oom_breakdown if mem is not None else None
    if oom and not oom.get("error"):
        cats = ", ".join(f"{k} {v:.2f}" for k, v in oom["by_category_mib"].items() if v)
        mods = ", ".join(f"{k} {v:.2f}" for k, v in oom["top_modules_mib"].items()) or "none"
        when = f" at step {oom['step']}" if oom["step"] is not None else ""
        lines.append(
            f"out of memory on rank {oom['rank']}{when} ({oom['phase']}): {oom['tracked_mib']:.2f} MiB "
            f"live over the {oom['limit_mib']:g} MiB budget: {cats}; top modules (MiB): {mods}; outside any "
            f"module {oom['outside_modules_mib']:.2f}"
        )
    elif result.status == "oom" and mem is not None and mem.oom_breakdown_error:
        lines.append(f"no out-of-memory breakdown: {mem.oom_breakdown_error}")
    snapshot = (getattr(mem, "memory_snapshot", None) if mem is not None else None) or {}
    if snapshot.get("files"):
        lines.append(f"memory snapshots (open at https://pytorch.org/memory_viz): {', '.join(snapshot['files'])}")
    profile = result.profile or {}
    if profile.get("files"):
        ms = lambda v: f"{v * 1e3:.1f} ms" if v is not None else "-"
        lines.append(
            f"profiler traces (open at https://ui.perfetto.dev) of steps {profile['steps']}: "
            f"{', '.join(profile['files'])}; {profile['size_mib_per_rank']:.2f} MiB each; a profiled step "
            f"{ms(profile['step_time_s_median'])}, unprofiled {ms(profile['unprofiled_step_time_s_median'])}"
        )
    elif profile.get("error"):
        lines.append(f"no profiler trace: {profile['error']}")
    return lines


def relative_error(predicted: dict[str, float], measured: dict[str, float]) -> float:
    """|predicted - measured| / measured over the three model states together."""
    p, m = sum(predicted.values()), sum(measured.values())
    return abs(p - m) / m if m else 0.0
