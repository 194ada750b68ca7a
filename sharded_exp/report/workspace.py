"""A saved W&B workspace view for a sweep: the comparison without building a chart by hand.

Built with ``wandb-workspaces`` (W&B's own library for workspaces and reports). Online it
is saved to the sweep's project and its URL printed; offline (the default here) its
specification is written as JSON beside the report, with the command that saves it
once the runs are synced (``wandb sync``).

Runs are grouped by strategy, world size and precision together (each group is one point
of the sweep; seeds of a point average), never collapsed by a maximum over other axes.
Sections: peak memory per point (bars; one bar per rank up to 8 ranks, the min / median /
max over ranks beyond), memory over time (a line per rank up to 8 ranks; the min / median /
max band over ranks always), memory and speed against world size (a panel per strategy),
predicted vs measured peak, and a parallel-coordinates panel over strategy / precision /
world size / model -> peak, samples/s, final loss. The view is filtered to the sweep's
W&B group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What the view plots and groups by is named in the vocabulary (wandb_group and PER_RANK_UP_TO are
# read through here too).
from sharded_exp.vocabulary.wandb_names import (  # noqa: F401
    CONFIG_AXES,
    GROUP_BY,
    PER_RANK_UP_TO,
    RESERVED_SECTION,
    panel_keys,
    wandb_group,
)

SPEC_FILE = "wandb_workspace.json"


def build(entity: str, project: str, group: str, world_size: int, strategies: list[str], name: str, cuda: bool = False):
    """The workspace object (nothing is sent anywhere). ``cuda``: a point ran on CUDA (reserved
    memory is then plotted too)."""
    import wandb_workspaces.reports.v2 as wr  # lazy: wandb_workspaces imports wandb; only --wandb-workspace needs it
    import wandb_workspaces.workspaces as ws  # lazy: (as above)

    keys = panel_keys(world_size, strategies, cuda)
    over_time = [
        wr.LinePlot(
            title="allocated (MiB): min / median / max over ranks", x="Step", y=keys["memory over time across ranks"]
        )
    ]
    over_time += [
        wr.LinePlot(title=f"rank {r}: allocated (MiB)", x="Step", y=[key])
        for r, key in enumerate(keys["memory over time per rank"])
    ]
    per_strategy = []
    for strategy, memory, speed in zip(strategies, keys["memory vs world size"], keys["throughput vs world size"]):
        per_strategy += [
            wr.ScatterPlot(title=f"{strategy}: peak per rank (MiB) vs world size", x="world_size", y=memory),
            wr.ScatterPlot(title=f"{strategy}: samples/s vs world size", x="world_size", y=speed),
        ]
    sections = [
        ws.Section(
            name="Peak memory per point",
            is_open=True,
            panels=[
                wr.BarPlot(title="Peak allocated per rank (MiB)", metrics=keys["peak per rank"]),
                wr.BarPlot(title="Model states per rank (MiB)", metrics=keys["model states per rank"]),
            ],
        ),
        ws.Section(name="Memory over time", is_open=True, panels=over_time),
        ws.Section(name="Memory and speed vs world size, per strategy", is_open=True, panels=per_strategy),
        ws.Section(
            name="Predicted vs measured",
            is_open=True,
            panels=[
                wr.ScatterPlot(title=title, x=keys[section][0], y=keys[section][1])
                for section, title in (
                    ("predicted vs measured", "Peak per rank: predicted (fake step) vs measured (MiB)"),
                    ("predicted vs measured step time", "Step time: predicted vs measured median (s)"),
                    (RESERVED_SECTION, "Peak reserved per rank: predicted (allocator model) vs measured (MiB)"),
                )
                if section in keys
            ],
        ),
        ws.Section(
            name="Strategy, precision, world size, model",
            is_open=True,
            panels=[
                wr.ParallelCoordinatesPlot(
                    title="Configuration -> peak, samples/s, final loss",
                    columns=[wr.ParallelCoordinatesPlotColumn(metric=wr.Config(key)) for key in CONFIG_AXES]
                    + [
                        wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(k))
                        for k in keys["parallel coordinates"]
                    ],
                )
            ],
        ),
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=sections,
        runset_settings=ws.RunsetSettings(
            filters=f"Metric('group') == '{group}'", groupby=[ws.Config(key) for key in GROUP_BY]
        ),
    )


def sweep_logger(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The W&B logger config the sweep's points ran with (None: the sweep did not use W&B)."""
    loggers = [p.get("config", {}).get("logger", {}) for p in points]
    return next((lg for lg in loggers if lg.get("name") == "wandb"), None)


def write_or_save(sweep_dir: Path, points: list[dict[str, Any]], entity: str | None, online: bool) -> str:
    """Build the sweep's view; save it (online) or write its specification (offline).
    Returns what to tell the user."""
    cfg = sweep_logger(points)
    if cfg is None:
        raise ValueError(f"the points under {sweep_dir} did not log to W&B (logger=wandb); no workspace to build")
    group = cfg.get("group") or wandb_group(sweep_dir)
    project = cfg.get("project") or "sharded_exp"
    world_size = max(int(p.get("world_size") or 1) for p in points)
    strategies = sorted({p["strategy"] for p in points if p.get("strategy")})
    cuda = any((p.get("device") or {}).get("type") == "cuda" for p in points)
    entity = entity or cfg.get("entity")
    name = f"sharded_exp sweep {group}"
    if online:
        if not entity:
            import wandb  # lazy: only to ask W&B for the default entity

            entity = wandb.Api().default_entity
        workspace = build(entity, project, group, world_size, strategies, name, cuda)
        workspace.save()
        return f"workspace saved: {workspace.url}"
    workspace = build(entity or "ENTITY", project, group, world_size, strategies, name, cuda)
    spec = json.loads(workspace._to_model().model_dump_json())  # the view as W&B stores it
    path = Path(sweep_dir) / SPEC_FILE
    path.write_text(
        json.dumps(
            {
                "entity": entity,
                "project": project,
                "group": group,
                "name": name,
                "panel_keys": panel_keys(world_size, strategies, cuda),
                "group_by": GROUP_BY,
                "config_axes": CONFIG_AXES,
                "spec": spec,
            },
            indent=2,
        )
    )
    # the points' runs, and the sweep's own report run (its tables and charts) beside them
    sync = f"wandb sync {Path(sweep_dir)}/*/wandb/offline-run-* {Path(sweep_dir)}/wandb/offline-run-*"
    save = f"python -m sharded_exp.report {sweep_dir} --wandb-workspace --online" + (
        "" if entity else " --entity YOUR_ENTITY"
    )
    return f"workspace specification: {path}\nto save it in W&B: {sync} && {save}"
