"""``model.config_file``: a Hugging Face ``config.json`` read and checked without torch or
transformers, so that the spelling layer (:mod:`sharded_exp.spelling`) refuses a wrong path or
a file that is no config in a second, before a run or a plan imports torch. Pre-flight then
reads it with ``AutoConfig`` (:func:`sharded_exp.models.target.check_config_file`)."""

from __future__ import annotations

import json
import os
from typing import Any

from sharded_exp.errors import ConfigError


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
