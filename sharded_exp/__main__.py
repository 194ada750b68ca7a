"""Entry point: ``python -m sharded_exp [group=option ...] [key=value ...]``.

    python -m sharded_exp                                   # defaults: CPU, 2 ranks, MLP, DDP
    python -m sharded_exp strategy=sharded_ddp precision=16
    python -m sharded_exp model=gpt strategy=oss trainer.world_size=4
    torchrun --nproc-per-node=2 -m sharded_exp strategy=oss  # ranks from torchrun, no spawning

The Hydra job is the parent: it validates the config and starts the ranks
(:mod:`sharded_exp.launch`). Output goes to the Hydra run directory (``outputs/...``).
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from sharded_exp.config import ConfigError, quote_numeric_choices, register_schemas
from sharded_exp.launch import launch

register_schemas()


def name_the_run(cfg: DictConfig) -> None:
    """Fill the tracker's group, job type and run name from Hydra, in the parent.

    Ranks have no HydraConfig, so these are resolved here: group = the sweep directory's
    name under -m (one group per sweep), else the run directory's; name = the overrides.
    """
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if cfg.logger.get("group", "missing") is None:
        cfg.logger.group = os.path.basename(hc.sweep.dir if multirun else hc.run.dir)
    if cfg.logger.get("job_type", "missing") is None:
        cfg.logger.job_type = cfg.strategy.name
    if cfg.logger.get("run_name", "missing") is None:
        cfg.logger.run_name = hc.job.override_dirname or "defaults"


# Sweep directories of multiruns run in this process, for the report at the end.
SWEEPS: set = set()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    output_dir = hc.runtime.output_dir
    name_the_run(cfg)
    try:
        result = launch(cfg, output_dir)
    except ConfigError as exc:  # raised before any rank starts
        print(f"error: {exc}", file=sys.stderr)
        if hc.mode != RunMode.MULTIRUN:
            sys.exit(2)
        result = record_config_error(cfg, output_dir, exc)
    if hc.mode == RunMode.MULTIRUN:
        # A failed point is data: record it and let the sweep go on (Hydra's basic sweeper
        # would stop at the first exception and never call on_multirun_end).
        SWEEPS.add(hc.sweep.dir)
        return
    if result["status"] != "ok":
        print(f"error: {result['error']} (details in {result['output_dir']}/result.json)", file=sys.stderr)
        sys.exit(1)


def record_config_error(cfg: DictConfig, output_dir: str, exc: Exception) -> dict:
    from omegaconf import OmegaConf

    from sharded_exp.results import base_result, write_json

    data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    result = {**base_result(data, None, output_dir), "status": "failed", "error": f"config: {exc}"}
    write_json(os.path.join(output_dir, "result.json"), result)
    return result


def finish_sweeps() -> int:
    """Write each sweep's report; exit status 1 if a point failed for a reason other than OOM."""
    from sharded_exp.report import write_report

    failed = 0
    for sweep_dir in sorted(SWEEPS):
        rows = write_report(sweep_dir)
        failed += sum(row["status"] == "failed" for row in rows)
        print(f"report: {os.path.join(sweep_dir, 'report.md')}", flush=True)
    if failed:
        print(f"error: {failed} sweep point(s) failed (status 'failed' in the report)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.argv[1:] = quote_numeric_choices(sys.argv[1:])
    main()
    sys.exit(finish_sweeps())
