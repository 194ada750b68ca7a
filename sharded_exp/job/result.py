"""result.json: its schema (the models below), its one writer (:func:`write_result`) and its
one reader (:func:`read_result`).

A job's ``result.json`` is written by the parent three times at most: ``running`` with the
prediction before any rank steps, then the end (``ok``, ``stopped``, ``diverged``, ``oom``
or ``failed``). Whoever builds a result (the parent, rank 0's training part, the probe)
builds a :class:`Result` (:meth:`Result.build`, :meth:`Result.updated`); readers use its
attributes. A result keeps its fields as they were given, in their order, so the file holds
exactly what its builders measured. Each write goes through :func:`write_result`, which
checks the content against :class:`Result`: a key no model declares is an error of ours,
found by the tests (every result.json the test suite writes is validated against the
published schema, ``docs/result.schema.json``: ``python -m sharded_exp.job.result >
docs/result.schema.json``). A result that does not match is still written, with a warning:
measuring never loses a run.

The top level is closed (every key declared here); sections whose keys depend on the
model, the device or the task (per-rank memory, history records, the config) are typed
where their keys are fixed and open where they are not.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, WithJsonSchema

from sharded_exp.errors import is_no_space, no_space

SCHEMA_VERSION = 1
"""Raised when a key is renamed or removed, or its meaning changes; a new key keeps it."""
TRAINED = "training.partial.json"
"""Rank 0's training figures, written into the run directory before the final evaluation: an
out-of-memory in that pass keeps them (the parent lays them under the failure and removes the file)."""
STATUSES = ("running", "ok", "stopped", "diverged", "oom", "failed")

Number = Annotated[Union[int, float], WithJsonSchema({"type": "number"})]
"""A figure kept as it was measured: pydantic turns an int given to a ``float`` field into a
float (3 becomes 3.0), so a section dumped from its model would no longer be what was written.
The JSON Schema still says ``number``."""


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Digest(_Closed):
    """float64 sum and L2 norm of a model's state (the same for every strategy)."""

    sum: Number
    """Sum of every element, in float64."""
    l2: Number
    """L2 norm over every element, in float64."""


class ZeroGrad(_Closed):
    requested: str
    """trainer.zero_grad as set."""
    applied: str
    """What the strategy did."""
    reason: str | None = None
    """Why they differ, or null."""


class Device(_Open):
    """What the job ran on (``accelerator`` is only what was asked for)."""

    type: Literal["cpu", "cuda"]
    """cuda or cpu."""
    name: str | None = None
    """The GPU's or CPU's model name."""
    count: int | None = None
    """GPUs visible, or CPU cores."""
    threads_per_rank: int | None = None
    """Intra-op threads each rank ran (CPU: the cores shared among the ranks)."""
    memory_gib: Number | None = None
    """The GPU's memory."""
    capability: str | None = None
    """CUDA compute capability."""
    cuda: str | None = None
    """CUDA version torch was built with."""
    nccl: str | None = None
    """NCCL version."""


class Throughput(_Open):
    """Speed of the timed steps (the steps after warm-up, the memory tracker and profiling)."""

    samples_per_s: Number | None = None
    """Samples per second of all ranks at the median step."""
    tokens_per_s: Number | None = None
    """Tokens per second (language models)."""
    step_time_s_median: Number | None = None
    """The median timed step."""
    step_time_s_iqr: Number | None = None
    """Its interquartile range."""
    step_time_s_ci95_low: Number | None = None
    """The median step time's 95% confidence interval (order statistics; None under 6 steps)."""
    step_time_s_ci95_high: Number | None = None
    """The median's 95% interval, upper end (order statistics; null under 6 steps)."""
    samples_per_s_ci95_low: Number | None = None
    """samples_per_s's 95% interval, lower end."""
    samples_per_s_ci95_high: Number | None = None
    """samples_per_s's 95% interval, upper end."""
    step_time_s_mean: Number | None = None
    """The mean timed step."""
    timed_steps: int | None = None
    """Steps timed (after warm-up, the CPU tracker's and the profiler's steps)."""
    step_times_s: list[Number] | None = None
    """Every timed step's time, in order."""
    load_avg_1m: Number | None = None
    """The machine's 1-minute load average over the timed steps (the larger of its start and end)."""
    cpu_count: int | None = None
    """Cores of the machine."""
    loop_time_s_per_step: Number | None = None
    """Whole loop iterations, harness included."""
    data_time_s_per_step: Number | None = None
    """The median wait for a step's batches plus their copy to the device."""
    data_prefetched: bool | int | None = None
    """Whether batches were made one step ahead in a background thread."""
    first_step_s: Number | None = None
    """The first step's time."""
    first_step_after_start_s: Number | None = None
    """Seconds from the job's start (the entry point's first line, before its imports: the
    timeline's ``main``) to rank 0's first step: the start-up a user waits through."""
    compile_s: Number | None = None
    """trainer.compile's extra time in the step that compiled."""
    model_flops_per_step: Number | None = None
    """The model's FLOPs per step, all ranks."""
    model_flops_per_step_per_rank: Number | None = None
    """The same, per rank."""
    achieved_flops_per_s: Number | None = None
    """model FLOPs per second per rank at the median step."""
    peak_flops_per_s: Number | None = None
    """The device's peak FLOPs per second."""
    peak_flops_source: str | None = None
    """Where that peak comes from (a table, or a matmul measured on this CPU)."""
    mfu_pct: Number | None = None
    """Model FLOPs utilisation, in percent."""
    predicted_step_time_s: Number | None = None
    """The step time the time model predicted before the run (its fake step's op trace priced
    on the ``this`` profile on CPU); None where it could not: ``step_time_prediction.error``."""
    step_time_rel_error: Number | None = None
    """(predicted - measured median) / measured median step time."""
    step_time_prediction: dict[str, Any] | None = None
    """The prediction's parts: compute_s, comm_s, exposed_comm_s, optimizer_s, the profile,
    its predicted MFU, the peak that MFU divides by (``peak_flops_per_s``: on CPU the run's
    ``mfu_pct`` divides by it too) and throughput per device, or the error that left it null.
    On CPU also ``threads_per_rank`` and ``fresh_pages_per_step``: the new pages glibc maps a
    step, as the time model prices them (beside each rank's measured ``page_faults_per_step``)."""


class Evaluation(_Closed):
    final: dict[str, Number]
    """The last pass: eval/loss and the task's metrics (eval/accuracy, eval/f1, eval/perplexity)."""
    history: list[dict[str, float | int]]
    """Every pass, with its step."""
    seconds: Number
    """Time the passes took (untimed steps)."""


class RankMemory(_Open):
    """One rank's memory: measured, predicted and its model states (per-rank figures a
    strategy or a device adds are open keys)."""

    rank: int
    """The rank."""
    peak_allocated_mib: Number | None = None
    """This rank's peak of live tensors over the measured steps."""
    peak_reserved_mib: Number | None = None
    """CUDA: the caching allocator's peak reserved bytes."""
    peak_error: str | None = None
    """Why this rank's peak is null."""
    freed_off_thread_max_mib: Number | None = None
    """CPU: the largest tensor a thread other than the training one freed while memory was
    tracked (gloo's worker, dropping a collective's buffer after the training thread moved
    on): the measured peak may hold one such buffer more than the prediction (program
    order); None on CUDA, whose allocator counters need no such note."""
    page_faults_per_step: Number | None = None
    """This rank's process: its minor page faults (``getrusage``'s ``ru_minflt``) per timed
    step, every thread's: the new pages it touched, which the kernel zeroes. On CPU, each
    block glibc maps anew and each page its heap gives back and takes again is faulted in
    every step (``trainer.host_mmap_threshold``; ``step_time_prediction.fresh_pages_per_step``
    is the time model's count). None without ``getrusage`` or timed steps."""
    heap_free_mib: Number | None = None
    """Host memory: what glibc's malloc heaps held free at the run's end (``mallinfo2``'s ``fordblks``):
    blocks below the rank's mmap threshold freed but kept by the process, part of its
    ``peak_rss_mib`` that no tensor holds (docs/concepts/memory.md, "On CPU: resident memory");
    None where the C library is not glibc."""
    pinned_host_mib: Number | None = None
    """CUDA: the pinned host memory torch's CachingHostAllocator held at the run's end, its
    blocks at their power-of-two sizes (CPU offload's shards, the data loader's pinned
    batches); beside the predicted ``memory.peak_prediction.host_breakdown_mib.pinned``
    (docs/concepts/memory.md, "Host memory under CPU offload"). None on CPU."""
    predicted_peak_mib: Number | None = None
    """This rank's predicted peak."""
    predicted_peak_reserved_mib: Number | None = None
    """CUDA: this rank's predicted peak reserved bytes (the fake step's allocations replayed
    through a model of torch's caching allocator), beside the measured ``peak_reserved_mib``;
    null on CPU (no caching allocator) or where nothing was predicted (``memory.predicted_peak_reserved_error``)."""
    model_states_mib: dict[str, Number] | None = None
    """params, grads, optimizer: what this rank holds, from the real tensors."""
    predicted_model_states_mib: dict[str, Number] | None = None
    """The same, predicted."""


class Memory(_Open):
    """Measured and predicted memory per rank, and their largest and mean over ranks."""

    per_rank: list[RankMemory] | None = None
    """One entry per rank."""
    source: str | None = None
    """cuda_allocator or torch_mem_tracker (CPU)."""
    memory_limit_applies_to: str | None = None
    """What trainer.memory_limit_mib bounded: reserved bytes (CUDA) or live tensors (CPU)."""
    peak_allocated_mib_max: Number | None = None
    """The largest per-rank peak of live tensors: what must fit."""
    peak_allocated_mib_mean: Number | None = None
    """The per-rank peak averaged over ranks (the seed study's figure)."""
    predicted_peak_mib_max: Number | None = None
    """The largest predicted per-rank peak (one fake step)."""
    predicted_peak_mib_mean: Number | None = None
    """The predicted peak averaged over ranks."""
    peak_reserved_mib_max: Number | None = None
    """CUDA: the largest per-rank peak reserved by the caching allocator (null on CPU)."""
    predicted_peak_reserved_mib_max: Number | None = None
    """CUDA: the largest predicted per-rank peak reserved (null on CPU)."""
    predicted_peak_reserved_error: str | None = None
    """Why there is no predicted reserved peak (a CPU run has no caching allocator; no fake step)."""
    predicted_model_states_mib_max: Number | None = None
    """The largest predicted parameters + gradients + optimizer state of a rank."""
    model_states_mib_max: Number | None = None
    """The largest measured parameters + gradients + optimizer state of a rank."""
    peak_rel_error_max: Number | None = None
    """The largest signed (predicted - measured) / measured over ranks."""
    peak_error: str | None = None
    """Why a rank's peak is null (its tracker could not measure)."""
    oom_breakdown: dict[str, Any] | None = None
    """What was live when the budget was first crossed: by category, by module, the phase; tracked_mib is the OOM's one number."""
    oom_breakdown_error: str | None = None
    """Why an out-of-memory has no breakdown."""


class Result(_Closed):
    """One job's result.json."""

    schema_version: int = SCHEMA_VERSION
    """Which version of this schema the file follows (docs/result.schema.json)."""
    status: Literal["running", "ok", "stopped", "diverged", "oom", "failed"]
    """running until the ranks finish; then ok, stopped (a signal), diverged (non-finite loss), oom or failed."""
    source: Literal["probe", "lightning", "transformers"] | None = None
    """What measured the run when it was not sharded_exp's own loop: a probe in your own script
    (``sharded_exp.probe``, ``sharded_exp.integrations.lightning`` or ``.transformers``); null for
    sharded_exp's runs."""
    error: str | None = None
    """Why the job did not end ok: the failing rank and its exception, or the refused setting; null when ok."""
    traceback: str | None = None
    """The failing rank's traceback (also in rank<r>_error.json)."""
    # what the job is
    strategy: str
    """The strategy option (strategy=...)."""
    precision: str
    """32, 16 or bf16."""
    model: str
    """The model option."""
    optimizer: str
    """The optimizer option."""
    world_size: int | None = None
    """Ranks that ran the job (torchrun's or SLURM's when they launched it)."""
    accelerator: str | None = None
    """What trainer.accelerator asked for (auto, cpu, gpu); what ran it is device."""
    params: int | None = None
    """Parameters of the model (counted on the meta device)."""
    steps: int | None = None
    """trainer.steps."""
    output_dir: str
    """The run directory."""
    config: dict[str, Any]
    """The resolved config with the parent's decisions (world size, checkpoint paths)."""
    overrides: list[str] | None = None
    """The point's overrides as typed (a sweep's point)."""
    sweep_id: str | None = None
    """The sweep this point belongs to (a report leaves out other sweeps' points)."""
    launcher: str | None = None
    """spawn (the parent started the ranks), torchrun or slurm."""
    zero_grad: ZeroGrad | None = None
    """How gradients were cleared between steps."""
    # how it went
    signal: int | None = None
    """The signal that stopped the job (status stopped)."""
    first_nonfinite_step: int | None = None
    """The first step whose loss was not finite on some rank; -1: none."""
    start_step: int | None = None
    """The step training started at (0, or the resumed checkpoint's)."""
    steps_done: int | None = None
    """Steps completed when the job ended (a failed job: those its first failing rank had
    completed; none where it failed before its first step)."""
    resumed_from: str | None = None
    """The checkpoint a resumed run started from."""
    resume_changes: list[dict[str, Any]] | None = None
    """Optimizer settings, and the data (data.length, path, content), changed against the resumed checkpoint's."""
    checkpoint: str | None = None
    """The newest complete checkpoint the job left (the one to resume)."""
    final_loss: Number | None = None
    """The last step's loss, averaged over ranks (``final_metrics.loss`` is the last logged
    interval's mean over its steps, as W&B's ``loss`` series is, whose summary is its minimum:
    they differ where an interval holds several steps)."""
    final_metrics: dict[str, float | int] | None = None
    """The last interval's record (the history's names)."""
    param_digest: Digest | None = None
    """float64 sum and L2 norm of the full model state, from each rank's shards: compares strategies."""
    history: list[dict[str, float | int]] | None = None
    """One record per trainer.log_interval: step, loss, accuracy or perplexity, each rank's memory (memory/per_rank/<r>/...)."""
    eval: Evaluation | None = None
    """The evaluation passes."""
    # what it measured
    memory: Memory | None = None
    """Measured and predicted memory."""
    throughput: Throughput | None = None
    """Speed of the timed steps."""
    profile: dict[str, Any] | None = None
    """Where trainer.profile's traces went."""
    timeline: dict[str, Number | None] | None = None
    """Wall-clock times of the job's phases (start, ranks ready, first step, end)."""
    device: Device | None = None
    """What ran the job."""

    _as_given: dict[str, Any] | None = PrivateAttr(default=None)
    """The fields as the builders gave them, in their order: what result.json holds (None: a
    result read back or validated directly, written from its fields that were set)."""

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Result:
        """A result from its fields (sections as plain data are validated into their models),
        written later exactly as given, in the order given. Fields that do not match the
        schema are our mistake, not the run's: the result keeps them, and :func:`write_result`
        writes them with a warning."""
        try:
            result = cls.model_validate(fields)
        except ValidationError:
            result = cls.model_construct(**{k: v for k, v in fields.items() if k in cls.model_fields})
        result._as_given = {
            k: v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v for k, v in fields.items()
        }
        return result

    @classmethod
    def build(cls, **fields: Any) -> Result:
        """:meth:`of`, field by field."""
        return cls.of(fields)

    def given(self) -> dict[str, Any]:
        """The fields that were set, as plain data: in the order the builders gave them, or,
        for a result read back, in the file's order (a field never set is left out, one set
        to null is kept as null; numbers keep their type)."""
        return dict(self._as_given) if self._as_given is not None else self.model_dump(exclude_unset=True)

    def as_written(self) -> dict[str, Any]:
        """What result.json holds: ``schema_version`` first, then :meth:`given`."""
        return {"schema_version": SCHEMA_VERSION, **self.given()}

    def updated(self, **fields: Any) -> Result:
        """This result with ``fields`` laid over it (a section given replaces the old one whole;
        a field already set keeps its place)."""
        return type(self).of({**self.as_written(), **fields})

    def has(self, name: str) -> bool:
        """Whether the field was set (to null, too): an older or a failed run's file lacks some."""
        return name in self.given()


class PartialResult(Result):
    """Part of a result: what rank 0 measured, which the parent lays over what it knows of the
    job; or a result.json as far as it goes, as a reader of other runs' files (the report) takes
    it: a file left by a run killed while running, or by an older sharded_exp, may lack keys a
    finished one has, and one from a newer sharded_exp of the same ``schema_version`` may hold
    keys this one does not know (kept as they are)."""

    model_config = ConfigDict(extra="allow")

    status: Literal["running", "ok", "stopped", "diverged", "oom", "failed"] | None = None
    strategy: str | None = None
    precision: str | None = None
    model: str | None = None
    optimizer: str | None = None
    output_dir: str | None = None
    config: dict[str, Any] | None = None

    def as_written(self) -> dict[str, Any]:
        """What the file held, or rank 0 sent (an older file without ``schema_version`` gets none)."""
        return self.given()


def schema() -> dict[str, Any]:
    """result.json's JSON Schema (draft 2020-12), generated from :class:`Result`."""
    out = Result.model_json_schema()
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["$id"] = "sharded_exp/result.schema.json"
    out["title"] = f"result.json, schema_version {SCHEMA_VERSION}"
    return out


def problems(data: dict[str, Any], strict: bool = False, ignore: tuple[str, ...] = ()) -> list[str]:
    """Where ``data`` does not match the schema (empty when it does). ``strict``: no value is
    converted (``"2"`` is not an int); ``ignore``: pydantic's error types to leave out
    (a reader may accept ``missing`` and ``extra_forbidden`` keys, as the report does)."""
    try:
        Result.model_validate(data, strict=strict)
    except ValidationError as exc:
        found = [e for e in exc.errors() if e["type"] not in ignore]
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in found]
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


def write_result(output_dir: str, result: Result) -> None:
    """``<output_dir>/result.json``, atomically, with its ``schema_version`` first: the one
    place a job's result is serialised."""
    data = result.as_written()
    found = problems(data)
    if found:  # our mistake, not the user's: the result is still kept
        print(
            f"warning: {output_dir}/result.json does not match its schema: {'; '.join(found[:5])}",
            file=sys.stderr,
            flush=True,
        )
    os.makedirs(output_dir, exist_ok=True)
    write_json(os.path.join(output_dir, "result.json"), data)


def read_json(path: str) -> Any:
    """A result.json's content as written (a reader that accepts older or foreign files checks
    it with :func:`problems` itself)."""
    with open(path) as f:
        return json.load(f)


def read_result(path: str, partial: bool = False) -> Result:
    """A result.json as its model: the one reader of result.json. Raises OSError when it cannot
    be read and ValueError (pydantic's ValidationError among them) when it is no JSON or does not
    match the schema.

    ``partial``: another run's file, read as far as it goes (a :class:`PartialResult`): missing
    and unknown keys are no error, but a value of the wrong type is, strictly (``"world_size":
    "2"`` is no number), and so is a newer ``schema_version``, whose keys may mean other things."""
    data = read_json(path)
    if not partial:
        return _as_read(Result.model_validate(data), data)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    version = data.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise ValueError(
            f"schema_version {version} is newer than this sharded_exp reads ({SCHEMA_VERSION}): "
            "its keys may mean other things; report it with the sharded_exp that wrote it"
        )
    wrong = problems(data, strict=True, ignore=("missing", "extra_forbidden"))
    if wrong:
        raise ValueError(f"does not match its schema: {'; '.join(wrong[:3])}")
    return _as_read(PartialResult.model_validate(data), data)


def _as_read(result: Result, data: dict[str, Any]) -> Result:
    """``result`` that, written again, holds what the file held, in its order."""
    result._as_given = data
    return result


if __name__ == "__main__":
    print(json.dumps(schema(), indent=2))
