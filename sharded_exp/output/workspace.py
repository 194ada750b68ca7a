"""A saved W&B workspace view for a sweep: the comparison without building a chart by hand.

Built with ``wandb-workspaces`` (W&B's own library for workspaces and reports). Online it
is saved to the sweep's project and its URL printed; offline (the default here) its
specification is written as JSON beside the report, with the command that saves it
once the runs are synced (``wandb sync``).

Sections: memory per rank (bars grouped by strategy), memory over time per rank (lines),
predicted vs measured peak, throughput vs world size, and a parallel-coordinates panel
over strategy / precision / world size / model -> peak, samples/s, final loss. The view
is filtered to the sweep's W&B group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPEC_FILE = "wandb_workspace.json"


def panel_keys(world_size: int) -> dict[str, list[str]]:
    """The metric keys each section plots (summary or history keys of the sweep's runs)."""
    ranks = range(world_size)
    return {
        "memory per rank": [f"mem/rank{r}/peak_allocated_mib" for r in ranks]
        + [f"mem/rank{r}/model_states_mib" for r in ranks],
        "memory over time": [f"mem/rank{r}/allocated_mib" for r in ranks],
        "predicted vs measured": ["mem/predicted_peak_mib_max", "mem/peak_allocated_mib_max"],
        "throughput vs world size": ["world_size", "throughput/samples_per_s"],
        "parallel coordinates": ["mem/peak_allocated_mib_max", "throughput/samples_per_s", "final_loss"],
    }


CONFIG_AXES = ["strategy.name", "precision.name", "trainer.world_size", "model.name"]
"""Run config keys the view groups and filters by (W&B flattens nested config with dots)."""


def build(entity: str, project: str, group: str, world_size: int, name: str):
    """The workspace object (nothing is sent anywhere)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    keys = panel_keys(world_size)
    by_strategy = wr.Config("strategy.name")
    sections = [
        ws.Section(
            name="Memory per rank",
            is_open=True,
            panels=[
                wr.BarPlot(
                    title="Peak allocated per rank (MiB)",
                    metrics=keys["memory per rank"][:world_size],
                    groupby=by_strategy,
                    groupby_aggfunc="max",
                ),
                wr.BarPlot(
                    title="Model states per rank (MiB)",
                    metrics=keys["memory per rank"][world_size:],
                    groupby=by_strategy,
                    groupby_aggfunc="max",
                ),
            ],  # fmt: skip
        ),
        ws.Section(
            name="Memory over time per rank",
            is_open=True,
            panels=[
                wr.LinePlot(title=f"rank {r}: allocated (MiB)", x="Step", y=[key])
                for r, key in enumerate(keys["memory over time"])
            ],  # fmt: skip
        ),
        ws.Section(
            name="Predicted vs measured",
            is_open=True,
            panels=[
                wr.ScatterPlot(
                    title="Peak per rank: predicted (fake step) vs measured (MiB)",
                    x=keys["predicted vs measured"][0],
                    y=keys["predicted vs measured"][1],
                ),
            ],  # fmt: skip
        ),
        ws.Section(
            name="Throughput vs world size",
            is_open=True,
            panels=[wr.ScatterPlot(title="samples/s vs world size", x="world_size", y="throughput/samples_per_s")],
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
                )  # fmt: skip
            ],
        ),
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=sections,
        runset_settings=ws.RunsetSettings(
            filters=f"Metric('group') == '{group}'", groupby=[ws.Config("strategy.name")]
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
    group = cfg.get("group") or Path(sweep_dir).name
    project = cfg.get("project") or "sharded_exp"
    world_size = max(int(p.get("world_size") or 1) for p in points)
    entity = entity or cfg.get("entity")
    name = f"sharded_exp sweep {group}"
    if online:
        if not entity:
            import wandb

            entity = wandb.Api().default_entity
        workspace = build(entity, project, group, world_size, name)
        workspace.save()
        return f"workspace saved: {workspace.url}"
    workspace = build(entity or "ENTITY", project, group, world_size, name)
    spec = json.loads(workspace._to_model().model_dump_json())  # the view as W&B stores it
    path = Path(sweep_dir) / SPEC_FILE
    path.write_text(
        json.dumps(
            {
                "entity": entity,
                "project": project,
                "group": group,
                "name": name,
                "panel_keys": panel_keys(world_size),
                "config_axes": CONFIG_AXES,
                "spec": spec,
            },
            indent=2,
        )
    )
    sync = f"wandb sync {Path(sweep_dir)}/*/wandb/offline-run-*"
    save = f"python -m sharded_exp.report {sweep_dir} --wandb-workspace --online" + (
        "" if entity else " --entity YOUR_ENTITY"
    )
    return f"workspace specification: {path}\nto save it in W&B: {sync} && {save}"
