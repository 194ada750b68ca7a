"""A failed job's result: the failure laid over what the job had written so far.

The first failure is the cause: the earliest record a rank left (``rank<n>_error.json``,
with its traceback), else the rank that died without one, else the signal that stopped the
job. An allocation failure anywhere makes the point "oom", a result rather than a crash.
What was measured before the failure stays: rank 0's training figures when it failed in
the final pass, the prediction, what the ranks that ran out held, and the newest complete
checkpoint to resume from.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Any

import torch.multiprocessing as mp

from sharded_exp.checkpoint.storage import complete_checkpoints
from sharded_exp.errors import OOM_SIGNS
from sharded_exp.job.result import TRAINED, Result, read_json
from sharded_exp.job.spec import JobSpec
from sharded_exp.launch.supervise import RankDied, Stopped
from sharded_exp.output.results import oom_memory, predicted_section


def failure_result(result: Result, exc: BaseException, spec: JobSpec) -> Result:
    """``result`` (the job's result as it started) once its ranks failed with ``exc``: the
    failure, and what was measured and saved before it."""
    output_dir = spec.output_dir
    # what training measured before a failure in the final pass, then how it failed
    result = failed(result.updated(**kept_training(output_dir)), exc, output_dir)
    from sharded_exp.measure.tracker import MemoryMeter  # lazy: torch's DTensor, which the parent needs only here

    limit_set = spec.config["trainer"]["memory_limit_mib"]
    applies = MemoryMeter.LIMIT_APPLIES_TO[spec.device_type] if limit_set else None
    if not result.has("memory"):  # what was expected, still
        result = result.updated(memory=predicted_section(spec.prediction, applies))
    if result.status == "oom":  # what the ranks that ran out held (from their error records)
        memory = result.as_written()["memory"]
        result = result.updated(memory={**memory, **oom_memory(rank_failures(output_dir))})
    if spec.checkpoint.every or isinstance(exc, Stopped):
        # stopped, killed or failed mid-way (in a save too): the newest complete checkpoint is the one to resume
        directory = spec.checkpoint.directory
        found = complete_checkpoints(directory) if directory and os.path.isdir(directory) else []
        result = result.updated(checkpoint=found[-1][1] if found else None)
    return result


def kept_training(output_dir: str) -> dict[str, Any]:
    """Rank 0's training figures when the job failed after training (in the final evaluation),
    without its status; {} when there are none."""
    try:
        kept = read_json(os.path.join(output_dir, TRAINED))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in kept.items() if k not in ("status", "error", "traceback", "timeline")}


def failed(result: Result, exc: BaseException, output_dir: str) -> Result:
    """``result`` with the status and error of a job whose ranks failed or were stopped."""
    first = None if isinstance(exc, (RankDied, Stopped)) else first_rank_failure(output_dir)
    if first is not None:
        result = result.updated(status="failed", error=first["error"], traceback=first["traceback"])
        if not result.has("steps_done") and first.get("steps_done") is not None:  # how far it got
            result = result.updated(steps_done=first["steps_done"])
    else:
        result = result.updated(status="failed", error=describe_failure(exc))
    if isinstance(exc, Stopped):
        result = result.updated(status="stopped", signal=exc.signum)
    if any(sign in result.error for sign in OOM_SIGNS):
        result = result.updated(status="oom")  # a result, not a crash: this point does not fit
    return result


def rank_failures(output_dir: str) -> list[dict[str, Any]]:
    """The rank failures recorded in ``output_dir``, earliest first."""
    records = []
    for name in os.listdir(output_dir):
        if name.startswith("rank") and name.endswith("_error.json"):
            with open(os.path.join(output_dir, name)) as f:
                records.append(json.load(f))
    return sorted(records, key=lambda r: r["time"])


def first_rank_failure(output_dir: str) -> dict[str, Any] | None:
    """The earliest rank failure recorded in ``output_dir``, if any."""
    records = rank_failures(output_dir)
    return records[0] if records else None


def describe_failure(exc: BaseException) -> str:
    """One line naming the failing rank and its exception."""
    if isinstance(exc, (RankDied, Stopped)):
        return str(exc)
    if isinstance(exc, mp.ProcessRaisedException):
        last = [line for line in exc.msg.strip().splitlines() if line.strip()][-1]
        return f"rank {exc.error_index}: {last.strip()}"
    if isinstance(exc, mp.ProcessExitedException):
        return f"rank {exc.error_index}: process exited with code {exc.exit_code}"
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
