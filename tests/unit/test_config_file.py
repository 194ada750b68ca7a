"""config_file.py: a Hugging Face model's config read and checked without torch: each bad
config.json named by its path, head counts that do not divide, a kernel that is not ours."""

from __future__ import annotations

import json
import re

import pytest
from omegaconf import OmegaConf

from sharded_exp.config_file import check_attn_name, check_head_counts, is_target_model, read_config_file
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


@pytest.mark.parametrize(
    "config, said",
    [
        ({"hidden_size": 128, "num_attention_heads": 7}, "model.config.hidden_size=128 is not divisible by model.config.num_attention_heads=7"),
        ({"n_embd": 64, "n_head": 0}, "model.config.n_embd=64 is not divisible by model.config.n_head=0"),
        ({"num_attention_heads": 8, "num_key_value_heads": 3}, "model.config.num_attention_heads=8 is not divisible by model.config.num_key_value_heads=3"),
    ],
)  # fmt: skip
def test_head_counts_that_do_not_divide_are_refused_naming_both(config, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        check_head_counts(OmegaConf.create({"name": "hf_llama", "config": config}))


def test_head_counts_that_divide_or_are_not_given_pass():
    check_head_counts(OmegaConf.create({"name": "hf_llama", "config": {"hidden_size": 128, "num_attention_heads": 4,
                                                                       "num_key_value_heads": 2}}))  # fmt: skip
    check_head_counts(OmegaConf.create({"name": "hf_llama", "config": {"hidden_size": 128}}))  # a default of the class
    check_head_counts({"name": "custom"})  # no config: nothing to check


def test_an_attention_kernel_not_ours_is_refused_naming_the_ones_allowed():
    check_attn_name({"attn_implementation": None})
    check_attn_name({"attn_implementation": "sdpa"})
    with pytest.raises(ConfigError, match=re.escape("model.attn_implementation='flash' is not one of null")):
        check_attn_name({"attn_implementation": "flash"})


def test_a_target_model_is_told_by_its_target_key_even_before_it_is_set():
    assert is_target_model(OmegaConf.create({"name": "custom", "_target_": "???"}))
    assert is_target_model({"_target_": "a.b"}) and not is_target_model(OmegaConf.create({"name": "mlp"}))
