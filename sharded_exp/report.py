"""Compare the points of a sweep: ``python -m sharded_exp.report SWEEP_DIR``.

Reads every ``result.json`` under SWEEP_DIR (a finished or interrupted multirun) and
writes ``report.md`` and ``report.csv`` there: one row per point, with the saving and
the speed relative to the DDP point of the same (model, precision, world size).

    python -m sharded_exp -m strategy=ddp,oss,sharded_ddp,zero1,fsdp,fsdp_grad_op \\
        trainer.world_size=2,4 model=gpt logger=none hydra.sweep.dir=outputs/six
    python -m sharded_exp.report outputs/six
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = [
    "strategy", "world_size", "precision", "model", "params", "peak_allocated_mib", "model_states_mib",
    "predicted_model_states_mib", "peak_saving_vs_ddp_pct", "states_saving_vs_ddp_pct", "samples_per_s",
    "speed_vs_ddp", "final_loss", "status",
]  # fmt: skip


def load_points(sweep_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).rglob("result.json"))]


def _row(r: dict[str, Any]) -> dict[str, Any]:
    mem = r.get("memory") or {}
    return {
        "strategy": r["strategy"],
        "world_size": r["world_size"],
        "precision": r["precision"],
        "model": r["model"],
        "params": r["params"],
        "peak_allocated_mib": mem.get("peak_allocated_mib_max"),
        "model_states_mib": mem.get("model_states_mib_max"),
        "predicted_model_states_mib": mem.get("predicted_model_states_mib_max"),
        "samples_per_s": (r.get("throughput") or {}).get("samples_per_s"),
        "final_loss": r.get("final_loss"),
        "status": r["status"],
    }


def build_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = [_row(r) for r in points]
    key = lambda row: (row["model"], row["precision"], row["world_size"])  # noqa: E731
    ddp = {key(row): row for row in rows if row["strategy"] == "ddp" and row["status"] == "ok"}
    for row in rows:
        base = ddp.get(key(row))
        for col, metric in (
            ("peak_saving_vs_ddp_pct", "peak_allocated_mib"),
            ("states_saving_vs_ddp_pct", "model_states_mib"),
        ):
            ok = base and row[metric] is not None and base[metric]
            row[col] = 100 * (1 - row[metric] / base[metric]) if ok else None
        ok = base and row["samples_per_s"] and base["samples_per_s"]
        row["speed_vs_ddp"] = row["samples_per_s"] / base["samples_per_s"] if ok else None
    order = ["ddp", "oss", "sharded_ddp", "zero1", "fsdp_grad_op", "fsdp"]
    rank = lambda s: order.index(s) if s in order else len(order)  # noqa: E731
    return sorted(rows, key=lambda r: (r["model"], r["precision"], r["world_size"], rank(r["strategy"])))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if value == 0 or abs(value) >= 0.01 else f"{value:.2e}"
    if isinstance(value, int) and value > 9999:
        return f"{value:,}"
    return str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def write_report(sweep_dir: Path) -> list[dict[str, Any]]:
    sweep_dir = Path(sweep_dir)
    rows = build_rows(load_points(sweep_dir))
    (sweep_dir / "report.md").write_text(
        f"# Sweep report: {sweep_dir.name}\n\nMemory in MiB, max over ranks; savings and speed relative to the DDP point "
        "of the same model, precision and world size.\n\n" + markdown(rows) + "\n"
    )
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"usage: python -m sharded_exp.report SWEEP_DIR  (got {argv!r})", file=sys.stderr)
        return 2
    rows = write_report(Path(argv[0]))
    if not rows:
        print(f"error: no result.json under {argv[0]}", file=sys.stderr)
        return 1
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
