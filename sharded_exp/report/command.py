"""Compare the points of a sweep: ``python -m sharded_exp.report SWEEP_DIR``.

    python -m sharded_exp -m strategy=ddp,oss,sharded_ddp,zero1,fsdp,fsdp_grad_op \
        trainer.world_size=2,4 model=gpt logger=none hydra.sweep.dir=outputs/six
    python -m sharded_exp.report outputs/six
    python -m sharded_exp.report outputs/six --wandb-workspace    # + the W&B workspace view

Reads every ``result.json`` under SWEEP_DIR (a finished or interrupted multirun) and
writes ``report.md``, ``report.csv`` and the charts there (:func:`sharded_exp.report.publish.write_report`).
A multirun writes its report itself, through :class:`ReportCallback` (conf/config.yaml).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import uuid
from pathlib import Path

from hydra.experimental.callback import Callback

from sharded_exp import sweep
from sharded_exp.report.sweep_points import SWEEP_ID


class ReportCallback(Callback):
    """Hydra callback: at the end of a multirun, write the sweep's report.

    Runs in the process that launched the sweep, with any launcher (local or SLURM), since
    sweep points record their failures in result.json instead of raising.
    """

    failed_points = 0
    lock = None
    """The sweep directory's lock, held from the sweep's start to its report."""

    def on_multirun_start(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        reused = (sweep_dir / SWEEP_ID).exists() or (sweep_dir / "multirun.yaml").exists()
        sweep.check_multirun(config, reused)  # a launcher that can host ranks, a valid objective: before any point
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            self.lock = sweep.hold_sweep_dir(
                sweep_dir
            )  # another live sweep there: refused (exit 2) before its id is touched
            (sweep_dir / SWEEP_ID).write_text(uuid.uuid4().hex + "\n")
        except OSError as exc:  # the points say so themselves; the report then takes every point
            print(f"warning: {sweep_dir / SWEEP_ID} not written ({exc.strerror or exc})", file=sys.stderr)

    def on_multirun_end(self, config, **kwargs) -> None:
        try:
            self._report(Path(config.hydra.sweep.dir))
        finally:
            sweep.release_sweep_dir(self.lock)
            self.lock = None

    def _report(self, sweep_dir: Path) -> None:
        # lazy: torch (the strategies' names and order), not for every job Hydra makes this callback for
        from sharded_exp.report.publish import write_report
        from sharded_exp.report.text import headline

        try:
            rows = write_report(sweep_dir)
        except OSError as exc:
            print(f"error: report not written in {sweep_dir}: {exc.strerror or exc}", file=sys.stderr)
            ReportCallback.failed_points += 1
            return
        if not rows:
            print(f"report: no result.json of this sweep under {sweep_dir}; no report written", file=sys.stderr)
            return
        failed = sum(row["status"] not in ("ok", "oom", "stopped") for row in rows)
        ReportCallback.failed_points += failed
        # the answer where the user looks: report.md's headline, then where the rest is
        print(f"{wrapped(headline(rows))}\nreport: {sweep_dir / 'report.md'} ({len(rows)} points)", flush=True)
        if failed:
            print(f"error: {failed} sweep point(s) failed or diverged (their status in the report)", file=sys.stderr)


def wrapped(text: str, width: int = 100) -> str:
    """``text`` in lines of at most ``width`` columns (a word longer than that alone on its line)."""
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sharded_exp.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument(
        "--wandb-workspace",
        action="store_true",
        help="also build the sweep's W&B workspace view (offline: its JSON specification beside the report)",
    )
    parser.add_argument("--online", action="store_true", help="save the workspace in W&B (needs the runs synced)")
    parser.add_argument("--entity", help="W&B entity of the workspace (default: the logger's, or your default)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # lazy: torch, which the multirun callback in this module must not import (above)
    from sharded_exp.report import workspace
    from sharded_exp.report.publish import write_report
    from sharded_exp.report.sweep_points import load_points
    from sharded_exp.report.text import compact, headline

    args = parse(sys.argv[1:] if argv is None else argv)
    if not args.sweep_dir.is_dir():
        print(
            f"usage: python -m sharded_exp.report SWEEP_DIR [--wandb-workspace] ({args.sweep_dir} is not a directory)",
            file=sys.stderr,
        )
        return 2
    try:
        rows = write_report(args.sweep_dir)
    except OSError as exc:
        print(f"error: report not written in {args.sweep_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if not rows:  # none at all, or only an earlier sweep's (said above by write_report)
        print(f"error: no result.json of the sweep that last ran under {args.sweep_dir}", file=sys.stderr)
        return 1
    print(f"{headline(rows)}\n\n{compact(rows)}\n\nreport: {args.sweep_dir / 'report.md'} (every column, the charts)")
    if args.wandb_workspace:
        try:
            print(workspace.write_or_save(args.sweep_dir, load_points(args.sweep_dir), args.entity, args.online))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:  # noqa: BLE001 -- W&B's own refusals (no API key, no network)
            if not type(exc).__module__.startswith("wandb"):
                raise
            print(
                f"error: W&B: {exc} (without --online the workspace is written as a file beside the report)",
                file=sys.stderr,
            )
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
