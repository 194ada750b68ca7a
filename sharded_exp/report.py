"""Compare the points of a sweep: ``python -m sharded_exp.report SWEEP_DIR``.

    python -m sharded_exp -m strategy=ddp,oss,sharded_ddp,zero1,fsdp,fsdp_grad_op \
        trainer.world_size=2,4 model=gpt logger=none hydra.sweep.dir=outputs/six
    python -m sharded_exp.report outputs/six

Reads every ``result.json`` under SWEEP_DIR (a finished or interrupted multirun) and
writes ``report.md``, ``report.csv`` and the charts there (:mod:`sharded_exp.output.report`).
A multirun writes its report itself, through :class:`ReportCallback` (conf/config.yaml).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from sharded_exp.output.report import markdown, write_report


class ReportCallback(Callback):
    """Hydra callback: at the end of a multirun, write the sweep's report.

    Runs in the process that launched the sweep, with any launcher (local or SLURM), since
    sweep points record their failures in result.json instead of raising.
    """

    failed_points = 0

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_report(sweep_dir)
        failed = sum(row["status"] == "failed" for row in rows)
        ReportCallback.failed_points += failed
        print(f"report: {sweep_dir / 'report.md'} ({len(rows)} points)", flush=True)
        if failed:
            print(f"error: {failed} sweep point(s) failed (status 'failed' in the report)", file=sys.stderr)


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
