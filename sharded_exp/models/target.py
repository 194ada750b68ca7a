"""Models given by ``_target_``: any Hugging Face class built from its config class (random
weights, no download), or a user's own factory. Built with Hydra's ``instantiate``.

    python -m sharded_exp model=hf_bert                              # BertForTokenClassification
    python -m sharded_exp model=hf_gpt2 strategy=fsdp                # GPT2LMHeadModel (tied LM head)
    python -m sharded_exp model=hf_bert model._target_=transformers.RobertaForTokenClassification \\
        model.config._target_=transformers.RobertaConfig             # any other Hugging Face class
    python -m sharded_exp model=custom model._target_=my_pkg.my_module.build +model.hidden=64
    python -m sharded_exp model=hf_gpt2 model.pretrained=/path/to/dir           # your weights (save_pretrained)
    python -m sharded_exp.plan model=hf_causal model.config_file=/path/to/config.json  # any causal LM's config

Two forms, told apart by whether ``model.config`` is itself a ``_target_`` node:

- Hugging Face: ``_target_`` is the model class and ``config`` its config class; the model
  is ``cls(config=instantiate(config))``. The other top-level keys (``vocab_size``,
  ``seq_len``, ``num_labels``) size the data task and are interpolated into ``config``.
- A factory: ``instantiate(model)`` calls ``_target_`` with every other key but ``name``.

The contract (the Hugging Face convention, which our MLP and GPT follow too): the model is
called with the data task's batch keys as keyword arguments and returns an object or a
dict with ``loss`` (and ``logits`` for the training metrics).

``model.attn_implementation`` (a Hugging Face class only): the attention kernel Hugging Face
runs, ``eager`` (its matmul-softmax-matmul, which keeps the attention probabilities for the
backward: what every model ran before PyTorch had SDPA) or ``sdpa``
(``torch.nn.functional.scaled_dot_product_attention``); null leaves Hugging Face's default
(sdpa where the class supports it). It is set on the config the model is built from, also
for ``model.pretrained``.

``model.pretrained=DIR`` (a Hugging Face class only): the architecture is the directory's
``config.json`` (``model.config`` is then ignored) and the ranks load its weights
(:mod:`sharded_exp.train.build`); the directory is one ``save_pretrained`` wrote. Nothing
is ever downloaded: a name that is not a local directory is refused.

``model.config_file=PATH`` (a Hugging Face class only): the architecture is that
``config.json`` (read by ``AutoConfig``; ``model.config`` is then replaced by it), with
random weights, so a published model is planned or trained from its config alone, without
its weights. ``model=hf_causal`` builds it with ``AutoModelForCausalLM`` (whatever
architecture the file's ``model_type`` names); the other Hugging Face options build their
own class, which must be of the file's ``model_type``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct

import torch
from hydra.utils import get_class, get_object, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from sharded_exp.config_file import check_attn_name, read_config_file
from sharded_exp.errors import ConfigError, missing_packages


def _plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def build_target_model(cfg, weights: bool = False) -> nn.Module:
    """The model of a ``_target_`` config (see the module docstring). With
    ``model.pretrained``: built from the directory's config.json, with its weights loaded
    only when ``weights`` (else initialised as the class does: random, or nothing on meta)."""
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
    attention = data.get("attn_implementation")
    try:
        if data.get("pretrained"):
            module = _pretrained_model(data, weights)
        elif isinstance(data.get("config"), dict) and "_target_" in data["config"]:
            module = _from_config(get_class(target), _with_attention(_config_of(data["config"]), attention))
        elif _is_auto_class(target):
            raise ConfigError(
                f"model={data.get('name')}: model._target_={target} builds whatever architecture a config names: "
                "give one with model.config_file=PATH (a config.json) or model.pretrained=DIR"
            )
        else:
            if attention is not None:
                check_attn_implementation(data)  # refused for a factory (the parent said so already)
            module = instantiate({k: v for k, v in data.items() if k not in ("name", *HF_KEYS)})
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a user's factory: name it and what it said
        raise ConfigError(f"model={data.get('name')}: building {target} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(module, nn.Module):
        got = "None (does it return the model?)" if module is None else f"a {type(module).__name__}"
        raise ConfigError(f"model={data.get('name')}: model._target_={target} returned {got}, not a torch.nn.Module")
    return module


HF_KEYS = ("pretrained", "config_file", "attn_implementation")
"""The Hugging Face options' own keys, which a factory (``model=custom``) is not called with."""


def _is_auto(cls) -> bool:
    """``transformers.AutoModel...``: a class that picks the architecture from a config and
    has no constructor of its own (``from_config`` builds it)."""
    return hasattr(cls, "from_config") and not hasattr(cls, "config_class")


def _is_auto_class(target) -> bool:
    """``model._target_`` names an ``AutoModel...`` class (:func:`_is_auto`). Located with
    ``get_object``: ``get_class`` logs an error for a factory function, and that log line
    would write a run directory for a config refused before the run."""
    try:
        obj = get_object(target)
    except Exception:  # noqa: BLE001 -- nothing at that path: the build says so
        return False
    return isinstance(obj, type) and _is_auto(obj)


def _config_of(node: dict):
    """The config class's instance of ``model.config``: its nested values (a config.json's
    ``rope_parameters``) passed as plain dicts and lists, which Hugging Face's typed
    config fields accept (OmegaConf's containers they refuse)."""
    return instantiate(node, _convert_="all")


def _from_config(cls, config) -> nn.Module:
    """``cls`` built from a Hugging Face ``config``: a model class by its constructor, an
    ``AutoModel...`` class by ``from_config`` (it has no constructor)."""
    return cls.from_config(config) if _is_auto(cls) else cls(config=config)


def _with_attention(config, attention: str | None):
    """The Hugging Face ``config`` with ``model.attn_implementation`` set (None: untouched,
    Hugging Face then picks its default when the model is built)."""
    if attention is not None:
        config._attn_implementation = attention
    return config


def check_attn_implementation(model_cfg) -> None:
    """``model.attn_implementation`` must be null or one of
    :data:`~sharded_exp.config_file.ATTN_IMPLEMENTATIONS`, on a
    Hugging Face model class that has that kernel: checked before any rank starts."""
    check_attn_name(model_cfg)  # one of ours, or null (also on the command line, before torch)
    value = model_cfg.get("attn_implementation")
    if value is None:
        return
    target = model_cfg.get("_target_")
    try:
        cls = get_class(target)
    except Exception:  # noqa: BLE001 -- not a class: a factory function, or nothing
        cls = None
    # a transformers PreTrainedModel (each has the flag) or an AutoModel class (from_config)
    if not (hasattr(cls, "_supports_sdpa") or hasattr(cls, "from_config")):
        raise ConfigError(
            f"model.attn_implementation={value} chooses a Hugging Face model's attention kernel; model._target_="
            f"{target} is no Hugging Face model class (a transformers PreTrainedModel): leave it null"
        )
    if value == "sdpa" and getattr(cls, "_supports_sdpa", True) is False:
        raise ConfigError(
            f"model.attn_implementation=sdpa: {cls.__name__} has no SDPA attention in this transformers; "
            "use eager, or null (Hugging Face's default)"
        )


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""What ``save_pretrained`` writes the weights to (one file, or shards and their index)."""


def pretrained_class(model_cfg, key: str = "pretrained"):
    """The Hugging Face class ``model._target_`` names, or ConfigError: pretrained weights
    (``key``: or a config.json) load into a transformers ``PreTrainedModel`` (or an
    ``AutoModel...`` class) only."""
    target = model_cfg.get("_target_")
    try:
        cls = get_class(target)
    except Exception:  # noqa: BLE001 -- not a class: a factory function, or nothing
        cls = None
    if not (hasattr(cls, "from_pretrained") and (hasattr(cls, "config_class") or hasattr(cls, "from_config"))):
        raise ConfigError(
            f"model.{key} needs a Hugging Face model class as model._target_ (a transformers PreTrainedModel "
            f"or AutoModel class, e.g. transformers.GPT2LMHeadModel); model._target_={target} is not one"
        )
    return cls


def pretrained_config(model_cfg):
    """The Hugging Face config of ``model.pretrained``'s directory (its config.json)."""
    from transformers import AutoConfig  # lazy: transformers is optional ([hf])

    cls = pretrained_class(model_cfg)
    path = model_cfg.get("pretrained")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    _builds(cls, config, f"model.pretrained={path}", model_cfg)
    return config


def _builds(cls, config, source: str, model_cfg) -> None:
    """``cls`` builds a model of ``config``'s architecture, or ConfigError naming both."""
    wanted = getattr(getattr(cls, "config_class", None), "model_type", None)
    mapping = getattr(cls, "_model_mapping", None)  # an AutoModel... class: the configs it builds
    if (wanted and config.model_type != wanted) or (not wanted and mapping is not None and type(config) not in mapping):
        builds = f"a {wanted} model" if wanted else f"no {config.model_type} model"
        raise ConfigError(
            f"{source} holds a {config.model_type} model (config.json's model_type) and "
            f"model._target_={model_cfg.get('_target_')} builds {builds}; choose the model=... option "
            f"or model._target_ of a {config.model_type} class"
        )


def check_pretrained(model_cfg) -> None:
    """``model.pretrained`` must name a local directory written by ``save_pretrained``
    (config.json and weights): checked before any rank starts. Makes the path absolute and
    takes the data task's sizes the directory's config defines (``vocab_size``, and
    ``num_labels`` where the model has that key: set from it), so the batches fit
    the saved model. ``seq_len`` must fit its positions."""
    path = model_cfg.get("pretrained")
    if not path:
        return
    path = str(path)
    if not os.path.isdir(path):
        raise ConfigError(
            f"model.pretrained={path} is not a local directory: weights are read only from a directory written by "
            "save_pretrained (nothing is downloaded from the Hugging Face Hub); give the path of such a directory, "
            "or model.pretrained=null for random weights"
        )
    files = sorted(os.listdir(path))
    if "config.json" not in files or not any(f in files for f in WEIGHT_FILES):
        raise ConfigError(
            f"model.pretrained={path} is not a directory written by save_pretrained: it needs config.json and the "
            f"weights ({' or '.join(WEIGHT_FILES[::2])}); it holds {', '.join(files[:8]) or 'nothing'}"
        )
    for name in files:  # the headers (a read of a few bytes each): a corrupt file is named here, not in the ranks
        if name.endswith(".safetensors"):
            _readable_safetensors(os.path.join(path, name))
    config = pretrained_config(model_cfg)
    with open_dict(model_cfg):
        model_cfg.pretrained = os.path.abspath(path)
        # what the ranks compare before they load (the directory may change meanwhile)
        model_cfg.pretrained_config_sha256 = _sha256(os.path.join(path, "config.json"))
    _adopt(model_cfg, config, "model.pretrained")


def _adopt(model_cfg, config, source: str) -> None:
    """``model.config`` becomes the Hugging Face ``config`` read from ``source`` (plain data
    with its class as ``_target_``), and the data task's sizes the config defines are taken
    from it: ``vocab_size``, and ``num_labels`` where the model has that key. A null
    ``seq_len`` becomes :data:`DEFAULT_SEQ_LEN` or the config's positions where fewer; a
    longer one than its positions is refused."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    with open_dict(model_cfg):
        # What is built is this architecture: result.json and W&B show it, not the option's
        # own model.config (ignored).
        kind = type(config)
        saved = json.loads(config.to_json_string(use_diff=True))  # plain data: string keys (id2label)
        model_cfg.config = {"_target_": f"{kind.__module__}.{kind.__name__}", **saved}
        for key in ("vocab_size", "num_labels"):  # vocab_size also for model=custom, which has none
            if (key in model_cfg or key == "vocab_size") and getattr(config, key, None) is not None:
                model_cfg[key] = getattr(config, key)
        if "seq_len" in model_cfg and model_cfg.seq_len is None:
            model_cfg.seq_len = min(DEFAULT_SEQ_LEN, positions or DEFAULT_SEQ_LEN)
    seq_len = model_cfg.get("seq_len")
    if positions and isinstance(seq_len, int) and seq_len > positions:
        raise ConfigError(
            f"model.seq_len={seq_len} is longer than {source}'s {positions} positions; use at most {positions}"
        )


DEFAULT_SEQ_LEN = 2048
"""The sequence length a config read from a file is planned at when ``model.seq_len`` is
null: the context LLaMA-1 and GPT-NeoX were trained at. A config's ``max_position_embeddings``
is what it can take (131,072 for Llama 3.1), not what it is usually trained at."""


def check_config_file(model_cfg) -> None:
    """``model.config_file`` must name a readable ``config.json`` of an architecture
    ``model._target_`` builds: checked before any rank starts, naming the path. Its config
    then replaces ``model.config`` (:func:`_adopt`), so the ranks, result.json and W&B all
    see the architecture read here; the path is made absolute."""
    path = model_cfg.get("config_file")
    if not path:
        config = model_cfg.get("config")
        has_config = config is not None and "_target_" in config
        if _is_auto_class(model_cfg.get("_target_")) and not has_config and not model_cfg.get("pretrained"):
            raise ConfigError(
                f"model={model_cfg.get('name')} builds the architecture a config.json names: give "
                "model.config_file=PATH (a config.json; random weights) or model.pretrained=DIR (a save_pretrained "
                "directory with weights)"
            )
        return
    path = str(path)
    if model_cfg.get("pretrained"):
        raise ConfigError(
            f"model.config_file={path} and model.pretrained={model_cfg.get('pretrained')} both give the architecture: "
            "model.pretrained's directory has its own config.json; set one of them"
        )
    read_config_file(path)  # a file, JSON, with a model_type: each refused naming the path
    from transformers import AutoConfig  # lazy: transformers is optional ([hf])

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, TypeError) as exc:  # an architecture this transformers does not know
        raise ConfigError(f"model.config_file={path}: transformers cannot read it: {exc}") from None
    _builds(pretrained_class(model_cfg, "config_file"), config, f"model.config_file={path}", model_cfg)
    with open_dict(model_cfg):
        model_cfg.config_file = os.path.abspath(path)
    _adopt(model_cfg, config, "model.config_file")


def _sha256(file: str) -> str:
    with open(file, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _readable_safetensors(file: str) -> None:
    """A safetensors file's header parses and every tensor it lists lies inside the file."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"its header claims {length} bytes; the file has {size}")
            header = json.loads(f.read(length))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        if ends and 8 + length + max(ends) > size:
            raise ValueError(f"its tensors need {8 + length + max(ends)} bytes; the file has {size} (truncated?)")
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise ConfigError(f"model.pretrained: {file} is not a readable safetensors file: {exc}") from None


def _unchanged_since_checked(data: dict) -> None:
    """The ranks load the directory pre-flight checked: its config.json must still be the one the
    parent read (its sha256, ``model.pretrained_config_sha256``), or the job would train another
    model than its prediction, result.json and W&B name."""

    checked = data.get(
        "pretrained_config_sha256"
    )  # set by check_pretrained: a config that was not checked is not compared
    if checked is None:
        return
    if _sha256(os.path.join(data["pretrained"], "config.json")) != checked:
        raise ConfigError(
            f"model.pretrained={data['pretrained']} changed after the job was checked: its config.json is not the "
            "one pre-flight read (the job would train another model than it predicted and records); keep the "
            "directory unchanged while a job reads it, and start the job again"
        )


def _pretrained_model(data: dict, weights: bool) -> nn.Module:
    cls = pretrained_class(data)
    if weights:
        _unchanged_since_checked(data)
        from transformers.utils import logging  # lazy: transformers is optional ([hf])

        logging.disable_progress_bar()  # one bar per rank, for a load of a second or two
        attention = data.get("attn_implementation")
        chosen = {} if attention is None else {"attn_implementation": attention}
        # float32 master weights, as every other model here (a half-precision file is upcast)
        return cls.from_pretrained(data["pretrained"], local_files_only=True, dtype=torch.float32, **chosen)
    config = _with_attention(pretrained_config(data), data.get("attn_implementation"))
    return _from_config(cls, config)


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
