"""The sweep report: every point of a sweep compared with its baseline.

    python -m sharded_exp.report outputs/six
    python -m sharded_exp.report outputs/six --wandb-workspace    # + the W&B workspace view

Reads every ``result.json`` of a sweep directory and writes ``report.md`` (a headline
computed from the sweep, a compact table, the charts, every column), ``report.csv`` and the
charts there, and, when the sweep logged to W&B, a "report" run in its group. A multirun
writes its report itself, through :class:`~sharded_exp.report.command.ReportCallback`.

The package, in the order the report is made: :mod:`~sharded_exp.report.sweep_points` (the
sweep's result.json files), :mod:`~sharded_exp.report.rows` (one row per point, its
baseline and the comparison), :mod:`~sharded_exp.report.statistics` (means over ranks, the
speed ratio's interval), :mod:`~sharded_exp.report.text` (the headline, the tables,
report.md), :mod:`~sharded_exp.report.figures` (the charts), :mod:`~sharded_exp.report.publish`
(the files put in place, the W&B report run), :mod:`~sharded_exp.report.workspace` (the
sweep's saved W&B view) and :mod:`~sharded_exp.report.command` (the command line and the
multirun callback).
"""
