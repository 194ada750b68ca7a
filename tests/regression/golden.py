"""The golden set: what today's code does, recorded, so that a refactor that must not change
behaviour can be held to it (issue 33: "record a golden set at today's main").

    python -m tests.regression.golden record OUT_DIR                       # about 4 min on 2 cores
    python -m tests.regression.golden record OUT_DIR --smoke               # a subset, 40 s (slow-tier test)
    python -m tests.regression.golden compare OLD_DIR NEW_DIR               # 3 s; exit 1 on any difference
    python -m tests.regression.golden record NEW_DIR --resume-from OLD_DIR  # resume OLD's checkpoints

What is recorded (CPU, gloo, 2 ranks, logger=none, tiny shapes, a few steps each):

- every strategy x precision 32, 16 x model mlp, gpt: a fresh 6-step run; a 3-step run with
  ``trainer.checkpoint_every=3``; a 6-step run with ``trainer.resume=auto`` continuing it;
- the other checkpoint format for ddp (dcp) and fsdp (consolidated), written and resumed;
  checkpoints resumed at another world size (2 -> 3 ranks) and by another strategy (ddp ->
  fsdp, both formats);
- each fault kind of ``SHARDED_EXP_FAULT`` (``sharded_exp/train/faults.py``), as a user runs
  it (``python -m sharded_exp`` in a subprocess, its exit code kept);
- one ``python -m sharded_exp.plan ... plan.format=json`` (GPT, ddp and fsdp, 2 ranks);
- one 2x3 sweep (``-m strategy=ddp,fsdp trainer.world_size=1,2,3``) and its report.

For each run ``OUT_DIR/golden.json`` holds every value of ``result.json`` flattened to dotted
paths, each under a rule (``RULES``): **exact** (digests, loss histories, predicted peaks,
model states, everything else a run decides) or **measured** (peaks of live tensors: within
10%); timings and machine facts are not compared. Also result.json's key set (its leaf key
paths, list indices as ``[]``), and for every checkpoint its ``meta.json`` (less the time),
its file names and a SHA-256 of every section's tensors and values. The checkpoints
themselves are kept in ``OUT_DIR/checkpoints/`` (each result.json in ``OUT_DIR/runs/``).

``--resume-from OLD_DIR``: every resume starts from OLD_DIR's checkpoint instead of the one
this recording just wrote (for ``resume=auto`` it is put in the run's checkpoint directory
first). Recorded with new code against a recording of old code, ``compare`` then says
whether old checkpoints resume bit-identically in the new code; recorded with old code
against a new recording, the reverse.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from benchmarks.common import markdown, run, save, strategy_names

ROOT = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_STEP = 6, 3
CHECKPOINT = f"step_{CHECKPOINT_STEP:08d}"
COMMON = [
    "trainer.warmup_steps=1",
    "trainer.batch_size=8",
    "trainer.log_interval=2",
    "trainer.progress_bar=false",
    "trainer.timeout_s=60",
    "logger=none",
]
# Shapes of the tests' TINY / TINY_GPT: small checkpoints (digests.py's GPT is 4x larger).
MODELS = {
    "mlp": ["model=mlp", "model.hidden=32", "model.depth=2"],
    "gpt": ["model=gpt", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
            "model.vocab_size=64"],
}  # fmt: skip
PRECISIONS = ["32", "16"]
FAULTS = {
    # kind: (fault, extra overrides, extra environment)
    "raise": ("rank=1,step=3", [], {}),
    "exit": ("rank=1,step=3", [], {}),
    "kill": ("rank=1,step=3", [], {}),
    "oom": ("rank=1,step=3", [], {}),
    "hang": ("rank=1,step=3", ["trainer.timeout_s=5"], {}),
    "stall": ("rank=1,step=3", ["trainer.timeout_s=5"], {"SHARDED_EXP_STALL_S": "30"}),
    "exit_in_save": ("rank=0,step=4", ["trainer.checkpoint_every=2"], {}),
    "inf_grad": ("rank=1,step=2", ["precision=16"], {}),
    "tracker_error": ("rank=1,step=0", [], {}),
    # The job is stopped at a step the ranks agree on about once a second: long enough to be
    # stopped, and which step it stops at is timing, not behaviour (STOPPED_FIELDS only).
    "sigterm": ("rank=1,step=3", ["trainer.steps=100000", "trainer.checkpoint_every=100000"], {}),
}
STOPPED_FIELDS = ["status", "signal", "error", "exit_code", "launcher"]
SWEEP = ["strategy=ddp,fsdp", "trainer.world_size=1,2,3"]
PLAN = [*MODELS["gpt"], "plan.strategies=[ddp,fsdp]", "plan.world_sizes=[2]", "plan.workers=1", "plan.format=json"]

# How each flattened value is compared: the first pattern that matches wins; the rest exact.
# "skip": timings and facts of the machine, not of the code.
RULES = [
    ("*traceback", "exception"),  # the exception, not the frames' paths and line numbers
    # The L2 norms of a digest: a sum of squares in float64 without a copy (vector_norm) adds
    # in another order than over a copy did: equal within 1e-9 relative (issue 34).
    ("*digest*.l2", "close"),
    ("report.csv.*.parity_vs_baseline", "close_abs"),  # a difference of two such norms: ~1e-14 absolute
    ("throughput.*", "skip"),
    ("timeline.*", "skip"),
    ("eval.seconds", "skip"),
    ("*.seconds", "skip"),
    ("device.*", "skip"),
    ("output_dir", "skip"),
    ("sweep_id", "skip"),  # a fresh random id per sweep, by design (a report reads only its own)
    ("memory.peak_rss_mib_max", "skip"),
    ("memory.per_rank.*.peak_rss_mib", "skip"),
    ("memory.per_rank.*.checkpoint_rss_growth_mib", "skip"),
    ("memory.per_rank.*.page_faults_per_step", "skip"),  # the process's, as its resident set
    ("memory.per_rank.*.heap_free_mib", "skip"),  # glibc's heaps: the process's, as its resident set
    ("report.csv.*.samples_per_s*", "skip"),  # with its interval
    ("report.csv.*.speed_*", "skip"),  # the ratio, its interval, whether it is within noise
    ("report.csv.*.load_avg_1m", "skip"),
    ("report.csv.*.mfu_pct", "skip"),
    # Peaks of live tensors, measured (CPU: torch's MemTracker): within 10%.
    ("memory.peak_allocated_mib_*", "measured"),
    ("memory.build_peak_mib_max", "measured_build"),
    ("memory.peak_rel_error_max", "measured_error"),
    ("memory.per_rank.*.peak_allocated_mib", "measured"),
    # What the peak held, by category, is a snapshot of one instant: where two instants come
    # within a few bytes of each other, which one is the peak is a race with gloo's threads
    # (seen: fsdp's rank 1 on a resume, 0.0137 MiB of Optstate at its peak in one recording,
    # none in the next, the peak itself equal within 10%). The peak is compared, not its parts.
    ("memory.per_rank.*.peak_breakdown_mib.*", "skip"),
    # FSDP's parameters gathered at the measured peak: a part of the same instant (seen:
    # fsdp_grad_op at 32, 0.0137 MiB in one recording, 0.0094 in the next of the same code).
    ("memory.transient_params_mib_max", "skip"),
    ("memory.per_rank.*.build_breakdown_mib.*", "skip"),
    ("memory.per_rank.*.build_peak_mib", "measured_build"),
    ("memory.per_rank.*.peak_rel_error", "measured_error"),
    ("memory.oom_breakdown*", "measured"),
    ("history.*.mem/*", "measured"),  # recorded before issue 34 (one name per figure)
    ("history.*.memory/*", "measured"),
    ("final_metrics.mem/*", "measured"),
    ("final_metrics.memory/*", "measured"),
    ("report.csv.*.peak_allocated_mib_*", "measured"),
    ("report.csv.*.peak_rel_error_max", "measured_error"),
    ("report.csv.*.peak_*saving_pct", "measured_pct"),
]
MEASURED = 0.10
CLOSE = 1e-9
"""Relative tolerance of the ``close`` rule (float64 sums added in another order)."""
"""Measured peaks agree within 10% of the larger; a relative error (a fraction) within 0.1 and
a saving in percent within 10 points, what a 10% change of the peak moves them by.

The build's peak (``measured_build``) may also differ by one float32 copy of the parameters:
DDP's initial broadcast of the module states (``_broadcast_coalesced`` over gloo) flattens
them into one buffer, and whether that buffer is gone before the next allocation is a race
with gloo's worker thread. Measured on this machine (a 3,466-parameter model under torch's
MemTracker, 30 builds per rank): 27,728 bytes 28 times, 41,592 (one copy more) twice;
with ``DDP(init_sync=False)`` 27,728 every time. On the tiny models here that is +50%."""

CATEGORIES = [
    ("*digest*", "digest"),
    ("history.*", "loss"),
    ("final_*", "loss"),
    ("eval.*", "loss"),
    ("memory.*predicted*", "predicted"),
    ("memory.peak_prediction.*", "predicted"),
    ("memory.*model_states*", "states"),
    ("checkpoint.*", "checkpoint"),
    ("report.*", "report"),
    ("plan.*", "plan"),
]


TMP = re.compile(r"\.tmp\.[0-9]+-[0-9]+")
"""An unfinished checkpoint's directory is named for its job (pid and a nonce): ``.tmp.<job>``."""


def canonical(value: Any) -> Any:
    return TMP.sub(".tmp.<job>", value) if isinstance(value, str) else value


def exception_line(value: Any) -> Any:
    """A traceback's last line, the exception and its message: its frames name files by the
    checkout's absolute path and line numbers, which a move of code changes by design."""
    lines = [line for line in str(value).splitlines() if line.strip()]
    return lines[-1] if lines else value


def rule(path: str) -> str:
    return next((r for pattern, r in RULES if fnmatch.fnmatchcase(path, pattern)), "exact")


def category(path: str, how: str) -> str:
    if how.startswith("measured"):
        return "measured"
    return next((c for pattern, c in CATEGORIES if fnmatch.fnmatchcase(path, pattern)), "other")


# ------------------------------------------------------------------------------ the runs
@dataclass
class Spec:
    """One run of the golden set: ``kind`` says how it is started."""

    name: str
    kind: str  # job (in-process launch), cli (python -m sharded_exp), plan, sweep
    overrides: List[str]
    run_dir: str = ""  # relative to OUT_DIR/runs; the name by default
    env: Dict[str, str] = field(default_factory=dict)
    writes: str = ""  # the checkpoint this run writes (a name under OUT_DIR/checkpoints)
    resumes: str = ""  # the checkpoint it resumes: "auto" in its run directory, else a name
    stopped: bool = False  # only STOPPED_FIELDS are deterministic (see FAULTS["sigterm"])


def specs(smoke: bool = False) -> List[Spec]:
    out: List[Spec] = []
    models = {"mlp": MODELS["mlp"]} if smoke else MODELS
    # --smoke: the unsharded baseline and one sharded strategy, the pair the cross-loading
    # runs below resume between; the full record runs every registered strategy.
    strategies = ["ddp", "fsdp"] if smoke else strategy_names()
    for model, shape in models.items():
        for strategy in strategies:
            for precision in PRECISIONS[:1] if smoke else PRECISIONS:
                base = [*shape, f"strategy={strategy}", f"precision={precision}", *COMMON]
                out += pair(f"{model}/{strategy}/{precision}", base)
    mlp = [*MODELS["mlp"], "precision=32", *COMMON]
    if not smoke:
        out += pair("formats/ddp/dcp", [*mlp, "strategy=ddp", "trainer.checkpoint_format=dcp"])
        out += pair("formats/fsdp/consolidated", [*mlp, "strategy=fsdp", "trainer.checkpoint_format=consolidated"])
    cross = {
        "cross/ddp_to_fsdp": ("mlp/ddp/32", ["strategy=fsdp"]),
        "cross/fsdp_2_to_3_ranks": ("mlp/fsdp/32", ["strategy=fsdp", "trainer.world_size=3"]),
        "cross/ddp_2_to_3_ranks": ("mlp/ddp/32", ["strategy=ddp", "trainer.world_size=3"]),
        "cross/ddp_dcp_to_fsdp": ("formats/ddp/dcp", ["strategy=fsdp"]),
        "cross/fsdp_consolidated_to_ddp_3_ranks": ("formats/fsdp/consolidated", ["strategy=ddp", "trainer.world_size=3"]),
        "cross/gpt_fsdp_16_to_zero1_3_ranks": ("gpt/fsdp/16", [*MODELS["gpt"], "strategy=zero1", "trainer.world_size=3",
                                                               "precision=16"]),
    }  # fmt: skip
    for name, (source, extra) in cross.items():
        if not smoke or name == "cross/ddp_to_fsdp":
            overrides = [*mlp, *extra] if "model=gpt" not in extra else [*extra, *COMMON]
            out.append(Spec(name, "job", [*overrides, f"trainer.steps={STEPS}"], resumes=source))
    for kind, (where, extra, env) in FAULTS.items():
        if not smoke or kind == "raise":
            overrides = [*mlp, "strategy=ddp", f"trainer.steps={STEPS}", *extra]
            env = {**env, "SHARDED_EXP_FAULT": f"{where},kind={kind}"}
            out.append(Spec(f"fault/{kind}", "cli", overrides, env=env, stopped=kind == "sigterm"))
    out.append(Spec("plan", "plan", PLAN))
    sweep = ["strategy=ddp,fsdp", "trainer.world_size=2"] if smoke else SWEEP
    out.append(Spec("sweep", "sweep", [*mlp, f"trainer.steps={STEPS}", *sweep]))
    return out


def pair(name: str, base: List[str]) -> List[Spec]:
    """A fresh run; a shorter run that checkpoints; a run that continues it (resume=auto)."""
    return [
        Spec(f"{name}/fresh", "job", [*base, f"trainer.steps={STEPS}"]),
        Spec(
            f"{name}/checkpoint",
            "job",
            [*base, f"trainer.steps={CHECKPOINT_STEP}", f"trainer.checkpoint_every={CHECKPOINT_STEP}"],
            run_dir=name,
            writes=name,
        ),  # fmt: skip
        Spec(
            f"{name}/resume",
            "job",
            [*base, f"trainer.steps={STEPS}", "trainer.resume=auto"],
            run_dir=name,
            resumes="auto",
        ),  # fmt: skip
    ]


# ------------------------------------------------------------------------------ flattening
def flatten(value: Any, prefix: str = "", indices: bool = True) -> Dict[str, Any]:
    """Leaves of nested dicts and lists by dotted path (list items by index, or ``[]``)."""
    out: Dict[str, Any] = {}
    if isinstance(value, dict) and value:
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}.", indices))
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}{i if indices else '[]'}.", indices))
    else:
        out[prefix[:-1]] = value
    return out


def normalised(value: Any, dirs: List[Path]) -> Any:
    """The recording's own directory (and --resume-from's) written as ``<out>``: two
    recordings compare equal."""
    text = json.dumps(value)
    for form in sorted({f for d in dirs for f in (str(d.resolve()), str(d))}, key=len, reverse=True):
        text = text.replace(json.dumps(form)[1:-1], "<out>")
    return json.loads(text)


def digest_of(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def record_result(result: Dict[str, Any], dirs: List[Path], key_sets: Dict[str, List[str]], **extra) -> Dict[str, Any]:
    """A result.json as golden.json keeps it: values by path (config by hash), the key set's id."""
    keys = sorted(set(flatten(result, indices=False)))
    key_set = digest_of(keys)
    key_sets[key_set] = keys
    result = normalised(result, dirs)
    values = flatten({k: v for k, v in result.items() if k != "config"})
    # The W&B group is named after the run directory with a hash of its path ("raise-e6b228"):
    # the one value of the config the recording's directory changes in a way <out> cannot.
    config = json.loads(json.dumps(result.get("config") or {}))
    (config.get("logger") or {}).pop("group", None)
    values["config"] = digest_of(config)
    values.update(extra)
    return {"values": {k: v for k, v in values.items() if rule(k) != "skip"}, "key_set": key_set}


# ------------------------------------------------------------------------------ checkpoints
def hash_tree(value: Any, h) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(f"key {key!r}".encode())
            hash_tree(value[key], h)
    elif isinstance(value, (list, tuple)):
        h.update(f"seq {len(value)}".encode())
        for item in value:
            hash_tree(item, h)
    else:
        h.update(f"value {value!r}".encode())


def sections(obj: Dict[str, Any], prefix: str) -> Dict[str, str]:
    out = {}
    for key, value in obj.items():
        h = hashlib.sha256()
        hash_tree(value, h)
        out[f"{prefix}{key}"] = h.hexdigest()[:16]
    return out


def record_checkpoint(path: Path) -> Dict[str, Any]:
    """meta.json (less its time), the file names, and a hash of every section's contents:
    the tensors by name and dtype, bit for bit, read back with torch (dcp through
    torch.distributed.checkpoint's own converter), not the bytes of the files."""
    import torch

    meta = json.loads((path / "meta.json").read_text())
    meta.pop("time", None)
    content: Dict[str, str] = {}
    if (path / ".metadata").exists():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(path), os.path.join(tmp, "full.pt"))
            content.update(sections(torch.load(os.path.join(tmp, "full.pt"), weights_only=False), "dcp."))
    for name in ("model.pt", "optim.pt", "train.pt"):
        if (path / name).exists():
            loaded = torch.load(path / name, weights_only=False)
            content.update(sections(loaded if isinstance(loaded, dict) else {"": loaded}, f"{name}."))
    files = sorted(p.name for p in path.iterdir() if not p.name.endswith(".distcp"))
    files.append(f"{len(list(path.glob('*.distcp')))} .distcp files")
    return flatten({"checkpoint": {"meta": meta, "files": files, "content": content}})


# ------------------------------------------------------------------------------ recording
def python(module: str, args: List[str], env: Dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        full.pop(key, None)
    return subprocess.run([sys.executable, "-m", module, *args], env=full, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def run_spec(spec: Spec, out_dir: Path, resume_from: Optional[Path], key_sets) -> Dict[str, Any]:
    runs = out_dir / "runs"
    run_dir = runs / (spec.run_dir or spec.name)
    overrides = list(spec.overrides)
    whose = None  # with --resume-from: "old" (resume_from's checkpoint) or "own" (it has none)
    if spec.resumes:
        name = spec.run_dir if spec.resumes == "auto" else spec.resumes
        old = resume_from / "checkpoints" / name / CHECKPOINT if resume_from is not None else None
        whose = None if old is None else "old" if old.is_dir() else "own"
        source = old if whose == "old" else out_dir / "checkpoints" / name / CHECKPOINT
        if spec.resumes != "auto":
            overrides.append(f"trainer.resume={source.resolve()}")
        elif whose == "old":
            # The old recording's checkpoint where resume=auto finds it, instead of this one's.
            target = run_dir / "checkpoints" / CHECKPOINT
            shutil.rmtree(target)
            shutil.copytree(source, target)
    record = run_kind(spec, overrides, run_dir, out_dir, resume_from, key_sets)
    if whose is not None:
        record["resumed"] = whose
    return record


def run_kind(spec, overrides, run_dir, out_dir, resume_from, key_sets) -> Dict[str, Any]:
    runs, dirs = out_dir / "runs", [out_dir, *([resume_from] if resume_from else [])]
    if spec.kind == "job":
        os.environ.update(spec.env)
        result = run(overrides, spec.run_dir or spec.name, root=runs, check=False)
        for key in spec.env:
            os.environ.pop(key)
        record = record_result(result, dirs, key_sets)
        if spec.writes:
            kept = out_dir / "checkpoints" / spec.writes / CHECKPOINT
            shutil.copytree(run_dir / "checkpoints" / CHECKPOINT, kept)
            record["values"].update(record_checkpoint(kept))
        return record
    if spec.kind == "cli":
        proc = python("sharded_exp", [*overrides, f"hydra.run.dir={run_dir}"], spec.env)
        result = json.loads((run_dir / "result.json").read_text())
        checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*") if p.name != ".lock")
        extra = {"exit_code": proc.returncode, "checkpoints_left": [canonical(c) for c in checkpoints]}
        record = record_result(result, dirs, key_sets, **flatten(extra))
        if spec.stopped:  # the key set is kept; of the values, those that are not timing
            record["values"] = {k: v for k, v in record["values"].items() if k.split(".")[0] in STOPPED_FIELDS}
        return record
    if spec.kind == "plan":
        proc = python("sharded_exp.plan", overrides, spec.env)
        if proc.returncode != 0:
            raise RuntimeError(f"plan: exit {proc.returncode}: {proc.stderr[-2000:]}")
        values = {f"plan.{k}": v for k, v in flatten(json.loads(proc.stdout)).items()}
        return {"values": {k: v for k, v in values.items() if rule(k) != "skip"}}
    if spec.kind == "sweep":
        proc = python("sharded_exp", ["-m", *overrides, f"hydra.sweep.dir={run_dir}"], spec.env, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"sweep: exit {proc.returncode}: {proc.stderr[-2000:]}")
        return record_sweep(run_dir, out_dir, dirs, key_sets)
    raise ValueError(spec.kind)


NUMBER = re.compile(r"-?\d[\d,]*(\.\d+)?(e[-+]?\d+)?")


def record_sweep(sweep: Path, out_dir: Path, dirs: List[Path], key_sets) -> Dict[str, Any]:
    """The report: report.csv's every cell by row and column (RULES say which are timings or
    measured); report.md with its numbers written as # (they are report.csv's); the charts'
    file names; and every point's result.json as runs ``sweep/<n>`` (returned under "points")."""
    rows = list(csv.DictReader(open(sweep / "report.csv")))
    values = flatten({"report": {"csv": rows}})
    md = [NUMBER.sub("#", line) for line in (sweep / "report.md").read_text().splitlines()]
    values["report.md"] = digest_of(md)
    values["report.md.lines"] = len(md)
    values["report.charts"] = sorted(p.name for p in sweep.glob("*.png"))
    points = {}
    for point in sorted(sweep.glob("*/result.json")):
        index = point.parent.name.split("_", 1)[0]
        points[f"sweep/{index}"] = record_result(json.loads(point.read_text()), dirs, key_sets)
    (out_dir / "report_md_masked.txt").write_text("\n".join(md) + "\n")
    return {"values": {k: v for k, v in values.items() if rule(k) != "skip"}, "points": points}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout.strip()


def commit() -> str:
    return git("rev-parse", "HEAD") + (" (modified)" if git("status", "--porcelain", "--untracked-files=no") else "")


def record(out_dir: Path, smoke: bool, resume_from: Optional[Path]) -> int:
    import torch

    if out_dir.exists() and any(out_dir.iterdir()):
        print(f"error: {out_dir} is not empty: record into a new directory", file=sys.stderr)
        return 2
    if resume_from is not None and not (resume_from / "golden.json").exists():
        print(f"error: --resume-from {resume_from}: no golden.json there", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: Dict[str, Any] = {}
    key_sets: Dict[str, List[str]] = {}
    resumed: Dict[str, List[str]] = {"old": [], "own": []}
    rows = []
    for spec in specs(smoke):
        t0 = time.time()
        rec = run_spec(spec, out_dir, resume_from, key_sets)
        runs.update(rec.pop("points", {}))
        if "resumed" in rec:
            resumed[rec.pop("resumed")].append(spec.name)
        runs[spec.name] = rec
        v = rec["values"]
        rows.append([spec.name, v.get("status", "-"), v.get("exit_code", "-"), v.get("param_digest.l2", "-"),
                     v.get("final_loss", "-"), f"{time.time() - t0:.1f}"])  # fmt: skip
        print(f"golden: {spec.name}: {v.get('status', 'done')} ({time.time() - t0:.1f} s)", file=sys.stderr, flush=True)
    golden = {
        "meta": {
            "commit": commit(),
            # The newest commit that changed the code recorded (the package, its configs).
            "code_commit": git("log", "-1", "--format=%H", "--", "sharded_exp", "pyproject.toml"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "smoke": smoke,
            "resume_from": str(resume_from) if resume_from else None,
            # With --resume-from: the runs that resumed its checkpoints, and those that
            # resumed this recording's own (the old recording kept no such checkpoint).
            "resumed_old_checkpoints": resumed["old"] if resume_from else None,
            "resumed_own_checkpoints": resumed["own"] if resume_from else None,
            "seconds": round(time.time() - started, 1),
        },
        "runs": runs,
        "key_sets": key_sets,
    }
    (out_dir / "golden.json").write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(markdown(["run", "status", "exit code", "param_digest.l2", "final_loss", "s"], rows))
    same = resume_matches_fresh(runs)
    print(f"\nresume = fresh (param_digest, bit for bit): {sum(same.values())} of {len(same)} pairs")
    for name, ok in same.items():
        if not ok:
            print(f"  differs: {name}")
    print(f"wrote {out_dir / 'golden.json'} ({len(runs)} runs, {golden['meta']['seconds']} s)")
    save("golden", {"out_dir": str(out_dir), "meta": golden["meta"], "runs": sorted(runs),
                    "resume_matches_fresh": same})  # fmt: skip
    return 0


def resume_matches_fresh(runs: Dict[str, Any]) -> Dict[str, bool]:
    """Per pair: does the resumed run end where the uninterrupted one does? (A fact of today's
    code, shown, not compared: the README promises it for fp32.)"""
    out = {}
    for name in runs:
        if name.endswith("/fresh") and name.replace("/fresh", "/resume") in runs:
            a, b = runs[name]["values"], runs[name.replace("/fresh", "/resume")]["values"]
            out[name[: -len("/fresh")]] = all(a.get(k) == b.get(k) for k in ("param_digest.sum", "param_digest.l2"))
    return out


# ------------------------------------------------------------------------------ comparing
def agree(how: str, old: Any, new: Any, params_mib: float = 0.0) -> bool:
    if how in ("exact", "exception") or not all(isinstance(x, (int, float)) for x in (old, new)):
        return old == new
    if how == "close":
        return abs(new - old) <= CLOSE * max(abs(old), abs(new))
    if how == "close_abs":
        return abs(new - old) <= CLOSE
    if how == "measured":
        return abs(new - old) <= MEASURED * max(abs(old), abs(new))
    if how == "measured_build":
        return abs(new - old) <= MEASURED * max(abs(old), abs(new)) or abs(new - old) <= params_mib * (1 + 1e-6)
    if how == "measured_error":
        return abs(new - old) <= MEASURED
    if how == "measured_pct":
        return abs(new - old) <= 100 * MEASURED
    raise ValueError(how)


def as_number(value: Any) -> Any:
    """report.csv's cells are text: compared as numbers where a rule says measured."""
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def differences(old: Dict[str, Any], new: Dict[str, Any]) -> List[List[Any]]:
    rows: List[List[Any]] = []
    for name in sorted(set(old["runs"]) | set(new["runs"])):
        if name not in new["runs"] or name not in old["runs"]:
            rows.append([name, "run", "-", "present" if name in old["runs"] else "missing",
                         "present" if name in new["runs"] else "missing", "exact"])  # fmt: skip
            continue
        a, b = old["runs"][name], new["runs"][name]
        if a.get("key_set") != b.get("key_set"):
            ka, kb = set(old["key_sets"].get(a.get("key_set"), [])), set(new["key_sets"].get(b.get("key_set"), []))
            rows.append([name, "keys", "result.json key set", f"{len(ka)} keys; only here: {short(ka - kb)}",
                         f"{len(kb)} keys; only here: {short(kb - ka)}", "exact"])  # fmt: skip
        va, vb = a["values"], b["values"]
        for path in sorted(set(va) | set(vb)):
            how = rule(path)
            if how == "skip":
                continue
            x, y = canonical(va.get(path, "(absent)")), canonical(vb.get(path, "(absent)"))
            if how == "exception":
                x, y = exception_line(x), exception_line(y)
            params_mib = 4 * (va.get("params") or 0) / 2**20  # one float32 copy of the parameters
            if path not in va or path not in vb or not agree(how, as_number(x), as_number(y), params_mib):
                rows.append([name, category(path, how), path, cell(x), cell(y), how])
    return rows


def short(keys: set, n: int = 4) -> str:
    return ", ".join(sorted(keys)[:n]) + (f" (+{len(keys) - n})" if len(keys) > n else "") if keys else "none"


def cell(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return (text[:60] + "...") if len(text) > 63 else text.replace("|", "\\|")


def largest_measured(old: Dict[str, Any], new: Dict[str, Any]) -> str:
    """The largest relative difference among the measured peaks (both recordings have them)."""
    worst = (0.0, "-", "-")
    for name, run_ in old["runs"].items():
        other = new["runs"].get(name, {}).get("values", {})
        for path, x in run_["values"].items():
            y = other.get(path)
            x, y = as_number(x), as_number(y)
            if rule(path) == "measured" and all(isinstance(v, (int, float)) for v in (x, y)) and max(x, y) > 0:
                worst = max(worst, (abs(x - y) / max(abs(x), abs(y)), name, path))
    return f"{worst[0]:.1%} ({worst[1]}: {worst[2]})"


def intended_by(rows: List[List[Any]], intended: List[Dict[str, str]]) -> tuple:
    """Split differences into (unexpected, intended): a difference is intended when an entry
    of ``intended`` matches its run, field and (if given) new value (fnmatch patterns)."""
    unexpected, expected = [], []
    for row in rows:
        why = next((e["why"] for e in intended if fnmatch.fnmatch(row[0], e.get("run", "*"))
                    and fnmatch.fnmatch(row[2], e["field"]) and fnmatch.fnmatch(str(row[4]), e.get("new", "*"))), None)  # fmt: skip
        (expected if why else unexpected).append(row + ([why] if why else []))
    return unexpected, expected


def _masked_report_diff(old_dir: Path, new_dir: Path) -> List[str]:
    import difflib

    a, b = old_dir / "report_md_masked.txt", new_dir / "report_md_masked.txt"
    if not (a.exists() and b.exists()):
        return []
    return [line for line in difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]  # fmt: skip


def compare(old_dir: Path, new_dir: Path, intended_file: Optional[Path] = None) -> int:
    old = json.loads((old_dir / "golden.json").read_text())
    new = json.loads((new_dir / "golden.json").read_text())
    intended = json.loads(intended_file.read_text())["intended"] if intended_file else []
    rows, expected = intended_by(differences(old, new), intended)
    compared = [rule(p) for r in old["runs"].values() for p in r["values"] if rule(p) != "skip"]
    measured = sum(how.startswith("measured") for how in compared)
    print(f"golden set: {old_dir} ({old['meta']['commit'][:12]}) vs {new_dir} ({new['meta']['commit'][:12]})")
    for meta in (new["meta"], old["meta"]):
        if meta.get("resume_from"):
            print(f"{meta['resume_from']}'s checkpoints resumed by {len(meta['resumed_old_checkpoints'])} runs; "
                  f"own checkpoints (none there) by {len(meta['resumed_own_checkpoints'])}")  # fmt: skip
    print(f"{len(old['runs'])} vs {len(new['runs'])} runs: {len(compared) - measured} values exact, {measured} "
          f"measured within {MEASURED:.0%}, {len(old['runs'])} key sets")  # fmt: skip
    print(f"largest measured difference: {largest_measured(old, new)}\n")
    if expected:
        print(f"{len(expected)} intended differences ({intended_file}):")
        for why in sorted({r[-1] for r in expected}):
            print(f"- {sum(r[-1] == why for r in expected)} x {why}")
        if any(r[2] == "report.md" for r in expected):
            print("  report.md, its numbers masked, old (-) and new (+):")
            print("\n".join(f"    {line[:240]}" for line in _masked_report_diff(old_dir, new_dir)))
        print()
    if not rows:
        print("| result |\n|---|\n| no differences |")
        return 0
    print(markdown(["run", "what", "field", "old", "new", "rule"], rows))
    by: Dict[str, int] = {}
    for row in rows:
        by[row[1]] = by.get(row[1], 0) + 1
    print(f"\n{len(rows)} differences: " + ", ".join(f"{k} {v}" for k, v in sorted(by.items())))
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the golden set, write OUT_DIR/golden.json and the checkpoints")
    rec.add_argument("out_dir", type=Path)
    rec.add_argument("--smoke", action="store_true", help="a subset: mlp, ddp and fsdp, fp32, one fault, small sweep")
    rec.add_argument("--resume-from", type=Path, help="resume this recording's checkpoints instead of our own")
    cmp_ = sub.add_parser("compare", help="compare two recordings; exit 1 on any difference")
    cmp_.add_argument("old_dir", type=Path)
    cmp_.add_argument("new_dir", type=Path)
    cmp_.add_argument(
        "--intended", type=Path, help="a JSON file of differences a change makes on purpose, each with why"
    )
    args = parser.parse_args(argv)
    if args.command == "compare":
        return compare(args.old_dir, args.new_dir, args.intended)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the golden set is CPU's, also on a GPU machine
    return record(args.out_dir, args.smoke, args.resume_from)


if __name__ == "__main__":
    sys.exit(main())
