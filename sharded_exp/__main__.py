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

from sharded_exp.config import quote_numeric_choices, register_schemas
from sharded_exp.launch import launch

register_schemas()


class RunFailed(RuntimeError):
    """A rank failed; result.json holds the details."""


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    result = launch(cfg, HydraConfig.get().runtime.output_dir)
    if result["status"] != "ok":
        raise RunFailed(f"{result['error']} (see {result['output_dir']}/result.json)")


if __name__ == "__main__":
    sys.argv[1:] = quote_numeric_choices(sys.argv[1:])
    main()
