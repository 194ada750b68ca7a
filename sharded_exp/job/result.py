"""result.json: its schema (the models below) and its one writer (:func:`write_result`).

A job's ``result.json`` is written by the parent three times at most: ``running`` with the
prediction before any rank starts, then the end (``ok``, ``stopped``, ``diverged``, ``oom``
or ``failed``). Each write goes through :func:`write_result`, which checks the content
against :class:`Result`: a key no model declares is an error of ours, found by the tests
(every result.json the test suite writes is validated against the published schema,
``docs/result.schema.json``: ``python -m sharded_exp.job.result > docs/result.schema.json``).
A result that does not match is still written, with a warning: measuring never loses a
run.

The top level is closed (every key declared here); sections whose keys depend on the
model, the device or the task (per-rank memory, history records, the config) are typed
where their keys are fixed and open where they are not.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from sharded_exp.errors import is_no_space, no_space

SCHEMA_VERSION = 1
"""Raised when a key is renamed or removed, or its meaning changes; a new key keeps it."""
STATUSES = ("running", "ok", "stopped", "diverged", "oom", "failed")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Digest(_Closed):
    """float64 sum and L2 norm of a model's state (the same for every strategy)."""

    sum: float
    l2: float


class ZeroGrad(_Closed):
    requested: str
    applied: str
    reason: str | None = None


class Device(_Open):
    """What the job ran on (``accelerator`` is only what was asked for)."""

    type: Literal["cpu", "cuda"]
    name: str | None = None
    count: int | None = None
    threads_per_rank: int | None = None
    memory_gib: float | None = None
    capability: str | None = None
    cuda: str | None = None
    nccl: str | None = None


class Throughput(_Open):
    """Speed of the timed steps (the steps after warm-up, the memory tracker and profiling)."""

    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s_median: float | None = None
    step_time_s_iqr: float | None = None
    step_time_s_ci95_low: float | None = None
    """The median step time's 95% confidence interval (order statistics; None under 6 steps)."""
    step_time_s_ci95_high: float | None = None
    samples_per_s_ci95_low: float | None = None
    samples_per_s_ci95_high: float | None = None
    step_time_s_mean: float | None = None
    timed_steps: int | None = None
    step_times_s: list[float] | None = None
    """Every timed step's time, in order."""
    load_avg_1m: float | None = None
    """The machine's 1-minute load average over the timed steps (the larger of its start and end)."""
    cpu_count: int | None = None
    loop_time_s_per_step: float | None = None
    data_time_s_per_step: float | None = None
    data_prefetched: bool | int | None = None
    first_step_s: float | None = None
    compile_s: float | None = None
    model_flops_per_step: float | None = None
    model_flops_per_step_per_rank: float | None = None
    achieved_flops_per_s: float | None = None
    peak_flops_per_s: float | None = None
    peak_flops_source: str | None = None
    mfu_pct: float | None = None


class Evaluation(_Closed):
    final: dict[str, float]
    history: list[dict[str, float | int]]
    seconds: float


class RankMemory(_Open):
    """One rank's memory: measured, predicted and its model states (per-rank figures a
    strategy or a device adds are open keys)."""

    rank: int
    peak_allocated_mib: float | None = None
    peak_reserved_mib: float | None = None
    peak_error: str | None = None
    freed_off_thread_max_mib: float | None = None
    """CPU: the largest tensor a thread other than the training one freed while memory was
    tracked (gloo's worker, dropping a collective's buffer after the training thread moved
    on): the measured peak may hold one such buffer more than the prediction (program
    order); None on CUDA, whose allocator counters need no such note."""
    predicted_peak_mib: float | None = None
    model_states_mib: dict[str, float] | None = None
    predicted_model_states_mib: dict[str, float] | None = None


class Memory(_Open):
    """Measured and predicted memory per rank, and their largest and mean over ranks."""

    per_rank: list[RankMemory] | None = None
    source: str | None = None
    memory_limit_applies_to: str | None = None
    peak_allocated_mib_max: float | None = None
    peak_allocated_mib_mean: float | None = None
    predicted_peak_mib_max: float | None = None
    predicted_peak_mib_mean: float | None = None
    predicted_model_states_mib_max: float | None = None
    model_states_mib_max: float | None = None
    peak_rel_error_max: float | None = None
    peak_error: str | None = None
    oom_breakdown: dict[str, Any] | None = None
    oom_breakdown_error: str | None = None


class Result(_Closed):
    """One job's result.json."""

    schema_version: int = SCHEMA_VERSION
    status: Literal["running", "ok", "stopped", "diverged", "oom", "failed"]
    error: str | None = None
    traceback: str | None = None
    # what the job is
    strategy: str
    precision: str
    model: str
    optimizer: str
    world_size: int | None = None
    accelerator: str | None = None
    params: int | None = None
    steps: int | None = None
    output_dir: str
    config: dict[str, Any]
    """The resolved config with the parent's decisions (world size, checkpoint paths)."""
    overrides: list[str] | None = None
    """The point's overrides as typed (a sweep's point)."""
    sweep_id: str | None = None
    launcher: str | None = None
    zero_grad: ZeroGrad | None = None
    # how it went
    signal: int | None = None
    first_nonfinite_step: int | None = None
    start_step: int | None = None
    steps_done: int | None = None
    resumed_from: str | None = None
    resume_changes: list[dict[str, Any]] | None = None
    checkpoint: str | None = None
    final_loss: float | None = None
    final_metrics: dict[str, float | int] | None = None
    param_digest: Digest | None = None
    history: list[dict[str, float | int]] | None = None
    eval: Evaluation | None = None
    # what it measured
    memory: Memory | None = None
    throughput: Throughput | None = None
    profile: dict[str, Any] | None = None
    timeline: dict[str, float | None] | None = None
    device: Device | None = None


def schema() -> dict[str, Any]:
    """result.json's JSON Schema (draft 2020-12), generated from :class:`Result`."""
    out = Result.model_json_schema()
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["$id"] = "sharded_exp/result.schema.json"
    out["title"] = f"result.json, schema_version {SCHEMA_VERSION}"
    return out


def problems(data: dict[str, Any]) -> list[str]:
    """Where ``data`` does not match the schema (empty when it does)."""
    try:
        Result.model_validate(data)
    except ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return []


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one.
    On a full disk: OSError "no space left on device while writing <path>", no tmp file left."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if is_no_space(exc, path):
            raise no_space(path) from None
        raise


def write_result(output_dir: str, result: dict[str, Any]) -> None:
    """``<output_dir>/result.json``, atomically, with its ``schema_version``: the one place a
    job's result is written."""
    data = {"schema_version": SCHEMA_VERSION, **result}
    found = problems(data)
    if found:  # our mistake, not the user's: the result is still kept
        print(f"warning: {output_dir}/result.json does not match its schema: {'; '.join(found[:5])}",
              file=sys.stderr, flush=True)  # fmt: skip
    os.makedirs(output_dir, exist_ok=True)
    write_json(os.path.join(output_dir, "result.json"), data)


def read_result(path: str) -> Result:
    """A result.json as its model (raises ValidationError when it does not match)."""
    with open(path) as f:
        return Result.model_validate(json.load(f))


if __name__ == "__main__":
    print(json.dumps(schema(), indent=2))
