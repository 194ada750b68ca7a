"""``result.json``: one file per job, the single source for tables, reports and W&B."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from sharded_exp.errors import is_no_space, no_space


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


def base_result(cfg_data: dict[str, Any], params: int, output_dir: str) -> dict[str, Any]:
    t = cfg_data["trainer"]
    return {
        "status": "running",
        "error": None,
        "strategy": cfg_data["strategy"]["name"],
        "precision": str(cfg_data["precision"]["name"]),
        "model": cfg_data["model"]["name"],
        "optimizer": cfg_data["optimizer"]["name"],
        "world_size": t["world_size"],
        "accelerator": t["accelerator"],
        "params": params,
        "steps": t["steps"],
        "output_dir": output_dir,
        "config": cfg_data,
    }


def format_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _eval_cell(result: dict[str, Any]) -> str:
    """The final evaluation in short: ``acc 0.91 f1 0.88`` or ``ppl 12.3``."""
    final = (result.get("eval") or {}).get("final") or {}
    short = {"eval/accuracy": "acc", "eval/f1": "f1", "eval/perplexity": "ppl"}
    cells = [f"{name} {final[key]:.3g}" for key, name in short.items() if key in final]
    return " ".join(cells) or "-"


def summary_table(result: dict[str, Any]) -> str:
    """The short end-of-run table printed by the parent."""
    tp = result.get("throughput") or {}
    mem = result.get("memory") or {}
    mib = lambda key: f"{mem[key]:.2f}" if mem.get(key) is not None else "-"
    header = [
        "strategy",
        "precision",
        "world_size",
        "model",
        "params",
        "final_loss",
        "samples/s",
        "step_ms",
        "peak_MiB",
        "pred_peak_MiB",
        "states_MiB",
        "pred_states_MiB",
        "mfu",
        "eval",
        "status",
    ]
    row = [
        result["strategy"],
        result["precision"],
        result["world_size"],
        result["model"],
        f"{result['params']:,}",
        f"{result['final_loss']:.4f}" if result.get("final_loss") is not None else "-",
        f"{tp['samples_per_s']:.1f}" if tp else "-",
        f"{1000 * tp['step_time_s_median']:.1f}" if tp else "-",
        mib("peak_allocated_mib_max"),
        mib("predicted_peak_mib_max"),
        mib("model_states_mib_max"),
        mib("predicted_model_states_mib_max"),
        f"{tp['mfu']:.1%}" if tp.get("mfu") is not None else "-",
        _eval_cell(result),
        result["status"],
    ]
    return format_table([row], header)
