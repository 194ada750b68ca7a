"""config_file.py: a Hugging Face config.json read without torch, each bad file named by its path."""

from __future__ import annotations

import json

import pytest

from sharded_exp.config_file import read_config_file
from sharded_exp.errors import ConfigError


def test_a_config_is_read_as_its_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert read_config_file(str(path)) == {"model_type": "llama", "hidden_size": 8}


@pytest.mark.parametrize(
    "content, said",
    [
        (None, "is no file"),
        ("directory", "is a directory"),
        ('{"model_type": ', "is not readable JSON: Expecting value"),
        (b"\xff\xfe{}", "is not readable JSON"),
        ('["llama"]', "is no Hugging Face config: it has no model_type"),
        ('{"hidden_size": 8}', "is no Hugging Face config: it has no model_type"),
    ],
)
def test_a_path_that_is_no_readable_config_is_named(content, said, tmp_path):
    path = tmp_path / "config.json"
    if content == "directory":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=rf"^model.config_file={path} {said}"):
        read_config_file(str(path))
