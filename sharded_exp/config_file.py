"""A Hugging Face model's config read and checked without torch or transformers, so that the
spelling layer (:mod:`sharded_exp.spelling`) refuses it in a second, before a run or a plan
imports torch: ``model.config_file`` (a wrong path, a file that is no config; pre-flight then
reads it with ``AutoConfig``, :func:`sharded_exp.models.target.check_config_file`), head counts
in ``model.config`` that do not divide, an attention kernel that is not one of ours. Pre-flight
holds the same rules (it runs these functions) where the command line did not run them
(torchrun, a library call)."""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import OmegaConf

from sharded_exp.errors import ConfigError

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
"""``model.attn_implementation`` values (null: Hugging Face's default). Hugging Face knows
others (flash_attention_2, flex_attention, ...): they need CUDA or packages beyond ours, and
the memory prediction fakes the step on CPU."""


def read_config_file(path: str) -> dict[str, Any]:
    """The JSON of ``path``, a Hugging Face config (it names its ``model_type``), or a
    ConfigError naming the path and what is wrong with it."""
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "no file"
        raise ConfigError(
            f"model.config_file={path} is {what}: give the path of a Hugging Face config.json "
            "(read from this machine; nothing is downloaded)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.config_file={path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(
            f"model.config_file={path} is no Hugging Face config: it has no model_type (the architecture, "
            "e.g. llama), which every config.json that save_pretrained writes has"
        )
    return data


HEAD_RULES = [
    ("hidden_size", "num_attention_heads"),  # each head a slice of the hidden size
    ("n_embd", "n_head"),  # GPT-2's names
    ("num_attention_heads", "num_key_value_heads"),  # grouped-query attention: query heads per key/value head
]
"""(divided, divisor) pairs of a Hugging Face config that must divide evenly: the class builds
with any numbers, and its forward fails on every rank."""


def check_head_counts(model_cfg) -> None:
    """The attention's head counts in ``model.config`` divide as the class's forward needs
    (refused before any rank starts, naming both values)."""
    config = model_cfg.get("config")
    if config is None:
        return
    for big, small in HEAD_RULES:
        a, b = OmegaConf.select(config, big, default=None), OmegaConf.select(config, small, default=None)
        if not (isinstance(a, int) and isinstance(b, int)):
            continue
        if b < 1 or a % b:
            raise ConfigError(
                f"model.config.{big}={a} is not divisible by model.config.{small}={b} (model={model_cfg.get('name')}): "
                f"the attention splits {big} into {small} equal parts"
            )


def is_target_model(cfg) -> bool:
    """A model built by ``_target_`` (a Hugging Face class or a user's factory), whose head
    counts and kernel name are checked here: not a registry model (``model=gpt``)."""
    return "_target_" in cfg.keys()  # keys(): also when the value is still missing (???)


def check_attn_name(model_cfg) -> None:
    """``model.attn_implementation`` is null or one of :data:`ATTN_IMPLEMENTATIONS` (whether
    the model's class has that kernel is pre-flight's to ask:
    :func:`sharded_exp.models.target.check_attn_implementation`)."""
    value = model_cfg.get("attn_implementation")
    if value is not None and value not in ATTN_IMPLEMENTATIONS:
        allowed = f"null (Hugging Face's default), {', '.join(ATTN_IMPLEMENTATIONS)}"
        raise ConfigError(f"model.attn_implementation={value!r} is not one of {allowed}")
