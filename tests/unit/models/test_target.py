"""models/target.py: models given by ``_target_`` (a factory, or a Hugging Face-shaped class built
from its config class), the refusals that name what is wrong, the attention-kernel and
pretrained-directory and config-file checks, the safetensors header check and the batch-key check."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.errors import ConfigError
from sharded_exp.models import target
from sharded_exp.models.target import (
    _readable_safetensors,
    _unchanged_since_checked,
    build_target_model,
    check_accepts,
    check_attn_implementation,
    check_config_file,
    check_pretrained,
    pretrained_class,
)
from tests.helpers.jobs import TINY_CONFIGS, write_tiny_config


class TinyConfig:
    """A Hugging Face-shaped config class: built by instantiate, read by the model."""

    def __init__(self, width: int = 3):
        self.width = width


class TinyModel(nn.Module):
    """A Hugging Face-shaped model class: ``cls(config=...)``, a ``_supports_sdpa`` flag."""

    _supports_sdpa = False

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.width, 2)


HERE = __name__


def test_a_factory_is_called_with_every_key_but_the_name():
    module = build_target_model({"name": "custom", "_target_": "torch.nn.Linear", "in_features": 5, "out_features": 3})
    assert isinstance(module, nn.Linear) and module.weight.shape == (3, 5)


def test_a_hugging_face_class_is_built_from_its_config_class_with_the_attention_kernel_set():
    cfg = {"name": "tiny", "_target_": f"{HERE}.TinyModel", "attn_implementation": "eager",
           "config": {"_target_": f"{HERE}.TinyConfig", "width": 7}}  # fmt: skip
    module = build_target_model(OmegaConf.create(cfg))
    assert isinstance(module, TinyModel) and module.fc.in_features == 7
    assert module.config._attn_implementation == "eager"
    plain = build_target_model({**cfg, "attn_implementation": None})
    assert not hasattr(plain.config, "_attn_implementation")


@pytest.mark.parametrize("cfg", [
    OmegaConf.create({"name": "custom", "_target_": "???"}), {"name": "custom", "_target_": ""},
    {"name": "custom", "_target_": None},
])  # fmt: skip
def test_a_missing_target_is_refused_naming_the_key(cfg):
    with pytest.raises(ConfigError, match=r"model=custom needs model._target_=package.module.factory"):
        build_target_model(cfg)


def test_a_target_in_a_package_not_installed_is_named_and_transformers_gets_the_extras_hint(monkeypatch):
    with pytest.raises(ConfigError, match=r"needs the package no_such_pkg_x, which is not installed here$"):
        build_target_model({"name": "m", "_target_": "no_such_pkg_x.build"})
    monkeypatch.setattr(target, "missing_packages", lambda names: list(names))
    with pytest.raises(ConfigError, match=r"needs the package transformers.*pip install -e '\.\[hf\]'"):
        build_target_model({"name": "m", "_target_": "transformers.GPT2LMHeadModel"})


def test_a_failing_factory_is_named_with_what_it_raised():
    with pytest.raises(
        ConfigError, match=r"(?s)model=custom: building torch.nn.Linear failed: .*TypeError.*out_features"
    ):
        build_target_model({"name": "custom", "_target_": "torch.nn.Linear", "in_features": 3})


def test_a_factory_returning_no_module_is_refused_naming_what_it_returned():
    with pytest.raises(ConfigError, match=r"returned a dict, not a torch.nn.Module"):
        build_target_model({"name": "custom", "_target_": "builtins.dict", "a": 1})
    with pytest.raises(ConfigError, match=r"returned None \(does it return the model\?\)"):
        build_target_model({"name": "custom", "_target_": "builtins.print", "end": ""})


def test_an_attention_kernel_for_a_factory_is_refused():
    with pytest.raises(ConfigError, match="no Hugging Face model class"):
        build_target_model({"name": "c", "_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1,
                            "attn_implementation": "eager"})  # fmt: skip


def test_the_attention_kernel_must_be_known_and_supported_by_the_class():
    check_attn_implementation({"_target_": "torch.nn.Linear"})  # null: nothing to check
    with pytest.raises(ConfigError, match=r"'flash' is not one of null \(Hugging Face's default\), eager, sdpa"):
        check_attn_implementation({"_target_": f"{HERE}.TinyModel", "attn_implementation": "flash"})
    check_attn_implementation({"_target_": f"{HERE}.TinyModel", "attn_implementation": "eager"})
    with pytest.raises(ConfigError, match="sdpa: TinyModel has no SDPA attention"):
        check_attn_implementation({"_target_": f"{HERE}.TinyModel", "attn_implementation": "sdpa"})


def test_pretrained_weights_need_a_hugging_face_class():
    with pytest.raises(ConfigError, match=r"model._target_=torch.nn.Linear is not one"):
        pretrained_class({"_target_": "torch.nn.Linear"})


# ------------------------------------------------------------------ model.pretrained's directory
def test_no_pretrained_is_nothing_to_check_and_a_missing_directory_is_refused(tmp_path):
    check_pretrained(OmegaConf.create({"pretrained": None}))
    with pytest.raises(ConfigError, match="is not a local directory"):
        check_pretrained(OmegaConf.create({"pretrained": str(tmp_path / "absent")}))


def test_a_directory_without_config_and_weights_is_refused_listing_what_it_holds(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=r"needs config.json and the weights.*it holds config.json, notes.txt"):
        check_pretrained(OmegaConf.create({"pretrained": str(tmp_path)}))


def _safetensors(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_whole_safetensors_file_reads(tmp_path):
    file = tmp_path / "model.safetensors"
    _safetensors(file, {"__metadata__": {}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    _readable_safetensors(str(file))


def test_a_truncated_safetensors_file_is_named(tmp_path):
    file = tmp_path / "model.safetensors"
    _safetensors(file, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(7))
    with pytest.raises(ConfigError, match=r"not a readable safetensors file: its tensors need \d+ bytes.*truncated"):
        _readable_safetensors(str(file))


def test_a_safetensors_header_longer_than_the_file_is_named(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(ConfigError, match="its header claims 100 bytes; the file has 10"):
        _readable_safetensors(str(file))


def test_a_corrupt_weights_file_is_named_before_the_config_is_read(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(ConfigError, match="model.safetensors is not a readable safetensors file"):
        check_pretrained(OmegaConf.create({"pretrained": str(tmp_path), "_target_": "torch.nn.Linear"}))


def test_the_ranks_refuse_a_directory_whose_config_changed_since_it_was_checked(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"a": 1}')
    checked = hashlib.sha256(b'{"a": 1}').hexdigest()
    _unchanged_since_checked({"pretrained": str(tmp_path), "pretrained_config_sha256": checked})
    _unchanged_since_checked({"pretrained": str(tmp_path)})  # never checked: not compared
    config.write_text('{"a": 2}')
    with pytest.raises(ConfigError, match="changed after the job was checked"):
        _unchanged_since_checked({"pretrained": str(tmp_path), "pretrained_config_sha256": checked})


# ------------------------------------------------------------------ batch keys
def test_a_forward_without_a_batch_key_is_refused_naming_it_and_kwargs_take_any():
    class Only(nn.Module):
        def forward(self, input_ids, labels=None):
            return input_ids

    class Any_(nn.Module):
        def forward(self, **batch):
            return batch

    check_accepts(Only(), ["input_ids", "labels"], "m", "task")
    check_accepts(Any_(), ["whatever"], "m", "task")
    with pytest.raises(ConfigError, match=r"forward\(\) has no argument attention_mask \(the batch's keys"):
        check_accepts(Only(), ["input_ids", "attention_mask"], "m", "task")


# ------------------------------------------------------------------ model.config_file
def _hf_causal(path) -> OmegaConf:
    from sharded_exp.compose import compose

    return compose(["model=hf_causal", f"model.config_file={path}"]).model


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_a_config_file_alone_builds_its_architecture_with_the_files_sizes(kind, tmp_path):
    import torch
    import transformers

    model_class, config_class, sizes = TINY_CONFIGS[kind]
    model_cfg = _hf_causal(write_tiny_config(tmp_path, kind))
    check_config_file(model_cfg)
    assert model_cfg.vocab_size == sizes["vocab_size"]  # the data task's vocabulary is the file's
    assert model_cfg.seq_len == sizes["max_position_embeddings"]  # null: its positions, fewer than the default
    with torch.device("meta"):
        built = build_target_model(model_cfg)
        direct = getattr(transformers, model_class)(getattr(transformers, config_class)(**sizes))
    assert type(built) is type(direct)
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in direct.parameters())


def test_a_config_file_keeps_a_seq_len_given_and_refuses_one_longer_than_its_positions(tmp_path):
    path = write_tiny_config(tmp_path, "llama")
    model_cfg = _hf_causal(path)
    model_cfg.seq_len = 16
    check_config_file(model_cfg)
    assert model_cfg.seq_len == 16
    model_cfg = _hf_causal(path)
    model_cfg.seq_len = 65
    with pytest.raises(ConfigError, match=r"model.seq_len=65 is longer than model.config_file's 64 positions"):
        check_config_file(model_cfg)


def test_a_missing_or_unreadable_config_file_is_refused_naming_its_path(tmp_path):
    with pytest.raises(ConfigError, match=rf"model.config_file={tmp_path / 'absent.json'} is no file"):
        check_config_file(_hf_causal(tmp_path / "absent.json"))
    with pytest.raises(ConfigError, match=rf"model.config_file={tmp_path} is a directory"):
        check_config_file(_hf_causal(tmp_path))
    (tmp_path / "broken.json").write_text('{"model_type": ')
    with pytest.raises(ConfigError, match=rf"model.config_file={tmp_path / 'broken.json'} is not readable JSON"):
        check_config_file(_hf_causal(tmp_path / "broken.json"))
    (tmp_path / "plain.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ConfigError, match="plain.json is no Hugging Face config: it has no model_type"):
        check_config_file(_hf_causal(tmp_path / "plain.json"))
    (tmp_path / "unknown.json").write_text('{"model_type": "no_such_architecture"}')
    with pytest.raises(ConfigError, match="unknown.json: transformers cannot read it"):
        check_config_file(_hf_causal(tmp_path / "unknown.json"))


def test_a_config_file_of_another_architecture_than_the_class_is_refused(tmp_path):
    from sharded_exp.compose import compose

    path = write_tiny_config(tmp_path, "qwen2")
    with pytest.raises(ConfigError, match=r"holds a qwen2 model .* builds a gpt2 model"):
        check_config_file(compose(["model=hf_gpt2", f"model.config_file={path}"]).model)
    import transformers

    transformers.T5Config(d_model=8, num_heads=2).save_pretrained(tmp_path / "t5")  # an encoder-decoder
    with pytest.raises(ConfigError, match=r"holds a t5 model .*AutoModelForCausalLM builds no t5 model"):
        check_config_file(_hf_causal(tmp_path / "t5" / "config.json"))


def test_a_config_file_is_not_taken_with_pretrained_weights_and_hf_causal_needs_one(tmp_path):
    model_cfg = _hf_causal(write_tiny_config(tmp_path, "llama"))
    model_cfg.pretrained = str(tmp_path)
    with pytest.raises(ConfigError, match="both give the architecture"):
        check_config_file(model_cfg)
    from sharded_exp.compose import compose

    with pytest.raises(ConfigError, match=r"model=hf_causal builds the architecture a config.json names"):
        check_config_file(compose(["model=hf_causal"]).model)
    with pytest.raises(ConfigError, match=r"model.config_file=PATH"):  # built without the check: named too
        build_target_model(compose(["model=hf_causal"]).model)
