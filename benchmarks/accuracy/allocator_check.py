"""The allocator model against the real CUDA caching allocator, sequence by sequence.

    python -m benchmarks.accuracy.allocator_check             # on a machine with CUDA: exit 1 on any mismatch
    python -m benchmarks.accuracy.allocator_check --list      # the sequences, without running them
    python -m benchmarks.accuracy.allocator_check --no-steps  # the sequences only

Then one training job per strategy at world size 1 (``python -m sharded_exp``, a GPT of 8
blocks, precision 32, trainer.accelerator=gpu): its result.json holds the
measured ``torch.cuda.memory_stats()`` peaks (``peak_allocated_mib``, ``peak_reserved_mib``)
beside the prediction the parent made before the ranks started, the fake step's allocations
replayed through the allocator model (``predicted_peak_reserved_mib``; allocated as torch counts
it is the predicted peak plus ``memory.peak_prediction.allocator.allocated_extra_mib``). Each
must agree within 3% (``STEP_TOLERANCE``).

Each sequence (the unit tests' sequences, ``tests/unit/predict/test_allocator.py``) runs in its
own process, with its ``PYTORCH_CUDA_ALLOC_CONF`` set before torch starts, as real tensors
(``torch.empty(n, dtype=uint8)`` on explicit streams). The same events replay through
``sharded_exp.predict.allocator``; ``torch.cuda.memory_stats()`` must equal the model exactly
for allocated, reserved, segments, active bytes, inactive split blocks, retries and OOMs.
A capacity limit (the OOM sequences) is ``torch.cuda.set_per_process_memory_fraction`` on the
GPU and ``memory_fraction`` in the model. A cross-stream free keeps its stream busy with
``torch.cuda._sleep`` so its event stays pending until the sequence synchronises that stream,
which is the model's rule. Writes outputs/benchmarks/allocator_check.json. Without CUDA it
says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIB = 2**20
OUT = Path("outputs/benchmarks")
SLEEP_CYCLES = 2_000_000_000  # about a second on a 1.5-2 GHz GPU: longer than any sequence

KEYS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "segment.all.current",
    "segment.all.peak",
    "active_bytes.all.current",
    "inactive_split.all.current",
    "num_alloc_retries",
    "num_ooms",
)


def _m(i, n, s=0):
    return ("malloc", i, n, s)


def _f(i):
    return ("free", i, 0, 0)


def _sequences() -> dict:
    """name -> (PYTORCH_CUDA_ALLOC_CONF, capacity limit in bytes or None, events)."""
    grow = [_m(i, 12 * MIB) for i in range(5)] + [_f(i) for i in range(5)] + [_m(10 + i, 13 * MIB) for i in range(4)]
    recipe = []
    for i in range(20):
        recipe += [_m(("w", i), 2000 * 2000 * 4), _m(("b", i), 2000 * 4)]
    cross = [_m("a", 8 * MIB), ("record_stream", "a", 0, 1), _f("a"), _m("b", 8 * MIB)]
    # freed on a side stream, asked for on the default one: a segment per stream, whole pages
    other_stream = [_m("a", 90 * MIB, 1), _f("a"), _m("b", 90 * MIB, 0), ("empty_cache", 0, 0, 0)]
    return {
        "small_and_large_pools": ("", None, [_m(1, MIB), _m(2, MIB + 1), _m(3, 1024), _m(4, 1024)]),
        "split_and_non_split": ("", None, [_m(1, 12 * MIB), _f(1), _m(2, 5 * MIB), _f(2), _m(3, 11 * MIB)]),
        "block_reused_across_sizes": ("", None, [_m(1, 8 * MIB), _m(2, 12 * MIB), _f(1), _f(2), _m(3, 20 * MIB)]),
        "fragmentation_new_segment": ("", None, [_m(1, 8 * MIB), _m(2, 8 * MIB), _f(1), _m(3, 10 * MIB)]),
        "max_split_size_mb": (
            "max_split_size_mb:32",
            None,
            [_m(1, 40 * MIB), _f(1), _m(2, 30 * MIB), _f(2), _m(3, 36 * MIB)],
        ),
        "max_split_size_release": ("max_split_size_mb:32", 64 * MIB, [_m(1, 40 * MIB), _f(1), _m(2, 30 * MIB)]),
        "batch_grows_plain": ("", None, grow),
        "batch_grows_expandable": ("expandable_segments:True", None, grow),
        "expandable_unmap": (
            "expandable_segments:True",
            None,
            [
                _m(1, 16_000_000),
                _m(2, 16_000_000),
                _m(3, 16_000_000),
                _f(2),
                ("empty_cache", 0, 0, 0),
                _f(1),
                _f(3),
                ("empty_cache", 0, 0, 0),
            ],
        ),
        "other_stream_plain": ("", None, other_stream),
        "other_stream_expandable": ("expandable_segments:True", None, other_stream),
        "record_stream_synced": ("", None, cross + [("sync", 0, 0, 1), _m("c", 8 * MIB)]),
        "record_stream_pending": ("", None, cross + [_m("c", 8 * MIB)]),
        "other_stream_no_reuse": ("", None, [_m(1, 8 * MIB, 0), _f(1), _m(2, 8 * MIB, 1)]),
        "oom_retry": ("", 40 * MIB, [_m(1, 12 * MIB), _m(2, 14 * MIB), _f(1), _f(2), _m(3, 30 * MIB), _m(4, 12 * MIB)]),
        "garbage_collection": (
            "garbage_collection_threshold:0.5",
            100 * MIB,
            [_m(1, 30 * MIB), _f(1), _m(2, 40 * MIB), _f(2), _m(3, 50 * MIB)],
        ),
        "zero_recipe_20_linears": ("", None, recipe),
    }


def _run_real(name: str) -> dict:
    """Child process: run one sequence on the real allocator; print its statistics as JSON."""
    import torch

    conf, limit, events = _sequences()[name]
    total = torch.cuda.get_device_properties(0).total_memory
    if limit is not None:
        torch.cuda.set_per_process_memory_fraction(limit / total)
    streams = {0: torch.cuda.current_stream()}
    live, oom = {}, None
    for op, ident, size, s in events:
        if s not in streams:
            streams[s] = torch.cuda.Stream()
        if op == "malloc":
            try:
                with torch.cuda.stream(streams[s]):
                    live[ident] = torch.empty(size, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError as e:
                oom = str(e).splitlines()[0]
                break
        elif op == "free":
            del live[ident]
        elif op == "record_stream":
            with torch.cuda.stream(streams[s]):
                torch.cuda._sleep(SLEEP_CYCLES)  # keep the stream busy: the event stays pending
            live[ident].record_stream(streams[s])
        elif op == "sync":
            (torch.cuda.synchronize() if s is None else streams[s].synchronize())
        elif op == "empty_cache":
            torch.cuda.empty_cache()
        elif op == "reset_peak":
            torch.cuda.reset_peak_memory_stats()
    stats = torch.cuda.memory_stats()
    torch.cuda.synchronize()
    return {"total_bytes": total, "oom": oom, "stats": {k: int(stats.get(k, 0)) for k in KEYS}}


def _run_model(name: str, total: int) -> dict:
    from sharded_exp.predict.allocator import Allocator, parse_alloc_conf

    conf, limit, events = _sequences()[name]
    fraction = None if limit is None else limit / total
    a = Allocator(parse_alloc_conf(conf), device_bytes=total, memory_fraction=fraction, device_total_bytes=total)
    r = a.replay(events)
    return {"oom": None if r.oom is None else str(r.oom), "stats": {k: int(r.stats[k]) for k in KEYS}}


STEP_TOLERANCE = 0.03
"""How far a training step's predicted allocated and reserved peaks may be from the measured."""
STEP_MODEL = ["model=gpt", "model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.seq_len=256"]


def _step_job(strategy: str, accelerator: str = "gpu", model: list[str] = STEP_MODEL) -> dict:
    """One short training job of ``strategy`` on one GPU (``accelerator``); its result.json."""
    import shutil

    out = OUT / "allocator_check" / strategy
    if out.exists():
        shutil.rmtree(out)
    args = [*model, f"strategy={strategy}", f"trainer.accelerator={accelerator}", "trainer.world_size=1",
            "trainer.steps=4", "trainer.warmup_steps=1", "trainer.batch_size=8", "trainer.eval_batches=0",
            "logger=none", "trainer.progress_bar=false", f"hydra.run.dir={out}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "sharded_exp", *args], capture_output=True, text=True, timeout=600)
    path = out / "result.json"
    if not path.exists():
        return {"status": "failed", "error": proc.stderr[-2000:]}
    return json.loads(path.read_text())


def _step_rows() -> tuple[list[dict], int]:
    """Each strategy's step: measured against predicted allocated and reserved peaks."""
    from benchmarks.common import strategy_names

    rows, bad = [], 0
    for name in strategy_names():
        result = _step_job(name)
        mem = result.get("memory") or {}
        rank = (mem.get("per_rank") or [{}])[0]
        extra = ((mem.get("peak_prediction") or {}).get("allocator") or {}).get("allocated_extra_mib")
        pairs = {
            "allocated": (None if rank.get("predicted_peak_mib") is None or extra is None
                          else rank["predicted_peak_mib"] + extra, rank.get("peak_allocated_mib")),
            "reserved": (rank.get("predicted_peak_reserved_mib"), rank.get("peak_reserved_mib")),
        }  # fmt: skip
        errors = {k: None if None in (p, m) or not m else (p - m) / m for k, (p, m) in pairs.items()}
        ok = result.get("status") == "ok" and all(e is not None and abs(e) <= STEP_TOLERANCE for e in errors.values())
        bad += not ok
        rows.append({"strategy": name, "status": result.get("status"), "pairs_mib": pairs, "errors": errors,
                     "error": result.get("error"), "why": mem.get("predicted_peak_reserved_error")})  # fmt: skip
        shown = ", ".join(f"{k} predicted {p} measured {m} ({'-' if e is None else f'{e:+.1%}'})"
                          for (k, (p, m)), e in zip(pairs.items(), errors.values()))  # fmt: skip
        print(f"step {name:14s} {result.get('status')}: {shown}  {'ok' if ok else 'OUTSIDE 3%'}")
    return rows, bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one sequence on the real allocator
    p.add_argument("--list", action="store_true", help="print the sequences and exit")
    p.add_argument("--no-steps", action="store_true", help="the sequences only, no training step per strategy")
    args = p.parse_args()
    seqs = _sequences()
    if args.list:
        for name, (conf, limit, events) in seqs.items():
            print(f"{name}: conf={conf!r} limit={limit} events={len(events)}")
        return 0
    if args.one:
        print(json.dumps(_run_real(args.one)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("allocator_check: no CUDA device here (torch.cuda.is_available() is False); nothing to compare")
        return 0
    rows, bad = [], 0
    for name, (conf, _, _) in seqs.items():
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        if not conf:
            env.pop("PYTORCH_CUDA_ALLOC_CONF")
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.accuracy.allocator_check", "--one", name],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            bad += 1
            rows.append({"sequence": name, "error": proc.stderr[-2000:]})
            print(f"{name}: FAILED to run\n{proc.stderr[-2000:]}")
            continue
        real = json.loads(proc.stdout.strip().splitlines()[-1])
        model = _run_model(name, real["total_bytes"])
        diffs = {k: (model["stats"][k], real["stats"][k]) for k in KEYS if model["stats"][k] != real["stats"][k]}
        if (model["oom"] is None) != (real["oom"] is None):
            diffs["oom"] = (model["oom"], real["oom"])
        bad += bool(diffs)
        rows.append({"sequence": name, "conf": conf, "model": model, "real": real, "diffs": diffs})
        verdict = (
            "ok" if not diffs else "MISMATCH " + ", ".join(f"{k}: model {m} real {r}" for k, (m, r) in diffs.items())
        )
        print(
            f"{name:28s} reserved peak {real['stats']['reserved_bytes.all.peak'] / MIB:8.2f} MiB  "
            f"allocated peak {real['stats']['allocated_bytes.all.peak']:>11d} B  {verdict}"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    steps, bad_steps = ([], 0) if args.no_steps else _step_rows()
    doc = {"meta": meta, "rows": rows, "steps": steps}
    (OUT / "allocator_check.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"{len(seqs) - bad}/{len(seqs)} sequences agree exactly ({meta['device']}, torch {meta['torch']})")
    if not args.no_steps:
        print(f"{len(steps) - bad_steps}/{len(steps)} strategies' steps within {STEP_TOLERANCE:.0%}")
    return 1 if bad or bad_steps else 0


if __name__ == "__main__":
    sys.exit(main())
