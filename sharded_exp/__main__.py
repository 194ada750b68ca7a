"""Entry point: ``python -m sharded_exp [group=option ...] [key=value ...]``.

    python -m sharded_exp                                   # defaults: CPU, 2 ranks, MLP, DDP
    python -m sharded_exp strategy=sharded_ddp precision=16
    python -m sharded_exp model=gpt strategy=oss trainer.world_size=4
    torchrun --nproc-per-node=2 -m sharded_exp strategy=oss  # ranks from torchrun, no spawning

The Hydra job is the parent: it validates the config and starts the ranks
(:mod:`sharded_exp.launch`). Output goes to the Hydra run directory (``outputs/...``).
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from sharded_exp.config import ConfigError, quote_numeric_choices, register_schemas
from sharded_exp.launch import launch

register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        result = launch(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as exc:  # raised before any rank starts
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if result["status"] != "ok":
        print(f"error: {result['error']} (details in {result['output_dir']}/result.json)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    sys.argv[1:] = quote_numeric_choices(sys.argv[1:])
    main()
