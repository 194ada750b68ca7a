"""Models given by ``_target_``: any Hugging Face class built from its config class (random
weights, no download), or a user's own factory. Built with Hydra's ``instantiate``.

    python -m sharded_exp model=hf_bert                              # BertForTokenClassification
    python -m sharded_exp model=hf_gpt2 strategy=fsdp                # GPT2LMHeadModel (tied LM head)
    python -m sharded_exp model=hf_bert model._target_=transformers.RobertaForTokenClassification \\
        model.config._target_=transformers.RobertaConfig             # any other Hugging Face class
    python -m sharded_exp model=custom model._target_=my_pkg.my_module.build +model.hidden=64

Two forms, told apart by whether ``model.config`` is itself a ``_target_`` node:

- Hugging Face: ``_target_`` is the model class and ``config`` its config class; the model
  is ``cls(config=instantiate(config))``. The other top-level keys (``vocab_size``,
  ``seq_len``, ``num_labels``) size the data task and are interpolated into ``config``.
- A factory: ``instantiate(model)`` calls ``_target_`` with every other key but ``name``.

The contract (the Hugging Face convention, which our MLP and GPT follow too): the model is
called with the data task's batch keys as keyword arguments and returns an object or a
dict with ``loss`` (and ``logits`` for the training metrics).
"""

from __future__ import annotations

import inspect

from torch import nn

from sharded_exp.errors import ConfigError, missing_packages


def is_target_model(cfg) -> bool:
    return "_target_" in cfg.keys()  # keys(): also when the value is still missing (???)


def _plain(cfg) -> dict:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def build_target_model(cfg) -> nn.Module:
    """The model of a ``_target_`` config (see the module docstring)."""
    from hydra.utils import get_class, instantiate
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig) and OmegaConf.is_missing(cfg, "_target_"):
        raise ConfigError(f"model={cfg.get('name')} needs model._target_=package.module.factory (the model to build)")
    data = _plain(cfg)
    target = data["_target_"]
    if target in (None, "", "???"):
        raise ConfigError(f"model={data.get('name')} needs model._target_=package.module.factory (the model to build)")
    package = target.split(".")[0]
    missing = missing_packages([package])
    if missing:
        hint = " (pip install -e '.[hf]')" if package == "transformers" else ""
        raise ConfigError(f"model={data.get('name')} needs the package {package}, which is not installed here{hint}")
    try:
        if isinstance(data.get("config"), dict) and "_target_" in data["config"]:
            module = get_class(target)(config=instantiate(data["config"]))
        else:
            module = instantiate({k: v for k, v in data.items() if k != "name"})
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a user's factory: name it and what it said
        raise ConfigError(f"model={data.get('name')}: building {target} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(module, nn.Module):
        got = "None (does it return the model?)" if module is None else f"a {type(module).__name__}"
        raise ConfigError(f"model={data.get('name')}: model._target_={target} returned {got}, not a torch.nn.Module")
    return module


def check_accepts(module: nn.Module, keys, model_name: str, task: str) -> None:
    """Refuse a model whose forward cannot take the task's batch keys as keyword arguments."""
    params = inspect.signature(module.forward).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    rejected = [k for k in keys if k not in params]
    if rejected:
        raise ConfigError(
            f"model={model_name} cannot take the batch of data={task}: forward() has no argument "
            f"{', '.join(rejected)} (the batch's keys are {', '.join(keys)}; its arguments are "
            f"{', '.join(params)}). Choose a task whose keys it takes (data=...), or accept them."
        )
