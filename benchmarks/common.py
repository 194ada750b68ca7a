"""Helpers for benchmarks: run real jobs in-process from the real config tree."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

from hydra import compose, initialize_config_dir

from sharded_exp.config import CONF_DIR, quote_numeric_choices, register_schemas
from sharded_exp.launch import launch

register_schemas()
OUT = Path("outputs/benchmarks")


def run(overrides: List[str], name: str) -> Dict[str, Any]:
    with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_numeric_choices(overrides))
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    result = launch(cfg, str(out))
    if result["status"] != "ok":
        raise RuntimeError(f"{name}: {result['error']}")
    return result


def markdown(header: List[str], rows: List[List[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, data: Any) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path
