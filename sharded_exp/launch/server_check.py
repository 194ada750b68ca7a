"""Pre-flight begun in the rank server while the parent goes on importing.

``python -m sharded_exp`` composes its config without torch (the registries' schemas come
from :mod:`sharded_exp.schema_cache`), then starts :func:`sharded_exp.launch.preflight.check`
in a process forked from the rank server, which has imported torch, the strategies and
``torch._dynamo`` (the fake step's) meanwhile. The parent imports what it needs to run the
ranks while that check runs, and takes its JobSpec when both are done: the check and the
parent's imports overlap. This module does not import torch.
"""

from __future__ import annotations

import os
from typing import Any

import hydra.core.utils
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sharded_exp import logs
from sharded_exp.compose import plain_registry_groups, point_dirname
from sharded_exp.launch import forkserver
from sharded_exp.registry import import_plugins


def start(cfg: DictConfig, output_dir: str, peak: bool = True) -> forkserver.Call:
    """Begin the job's pre-flight check in the rank server; the first ``.result()`` is its
    JobSpec (the config checked), and, where that spec's ``wait_for_release`` is set, the second
    its peak prediction (made while the ranks start); either one a ConfigError raised instead
    (:func:`~sharded_exp.launch.preflight.check_in_two`).
    The check's log lines go to the parent's console and log file."""
    # Hydra's node of the config (what ${hydra:...} in the config reads) hangs from the whole
    # config as Hydra composed it (HydraConfig.set_config); the registries' groups travel as
    # plain data in both: the schemas made from the cache exist only in this process.
    whole = HydraConfig.instance().cfg.hydra._get_parent()
    here = {
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "hydra": plain_registry_groups(whole),
        "log_file": logs.job_log_file(),
        "log_level": logs.level(),
    }
    return forkserver.start(_check_there, plain_registry_groups(cfg), output_dir, peak, here, answers=2)


def _check_there(cfg: DictConfig, output_dir: str, peak: bool, here: dict[str, Any]):
    """The checking process: the parent's environment, directory, Hydra resolvers and
    logging, then pre-flight's :func:`~sharded_exp.launch.preflight.check_in_two` (a
    generator: its answers, two where the ranks may start before the peak is known)."""
    from sharded_exp.launch import preflight  # lazy: torch; this runs in the server, which has imported it

    os.environ.clear()
    os.environ.update(here["env"])
    os.chdir(here["cwd"])
    logs.setup_forked("parent", here["log_file"], here["log_level"])
    hydra.core.utils.setup_globals()  # ${now:...}, ${hydra:...}
    OmegaConf.register_new_resolver("point_dirname", point_dirname, replace=True)  # a sweep's subdir
    # the parent's Hydra config as it holds it (as HydraConfig.set_config makes it, without
    # making the node read-only again): its node, with the whole config it refers to
    # (${paths.output_dir}) and the ${now:...} it resolved
    hydra_cfg = OmegaConf.masked_copy(here["hydra"], "hydra")
    hydra_cfg.hydra._set_parent(here["hydra"])
    HydraConfig.instance().cfg = hydra_cfg
    import_plugins()
    yield from preflight.check_in_two(cfg, output_dir, peak)
