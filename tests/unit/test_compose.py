"""sharded_exp.compose: numeric group choices made names (precision=16 -> fp16, in sweeps,
choice(), glob()), a sweep point's directory name, the registries' schema cache, and
compose() itself."""

from __future__ import annotations

import hashlib
import json

import pytest

from sharded_exp import compose as compose_mod
from sharded_exp.compose import (
    CACHE_FORMAT,
    MAX_DIRNAME,
    compose,
    numbers_named,
    point_dirname,
    quote_numeric_choices,
    registry_schemas,
    schemas_cache_file,
)

NAMES = {"32": "fp32", "16": "fp16"}


@pytest.mark.parametrize(
    "arg, out",
    [
        ("precision=16", "precision=fp16"),
        ("precision=32,16", "precision=fp32,fp16"),
        ("precision='16'", "precision=fp16"),
        ('precision="32"', "precision=fp32"),
        ("precision=choice(32,bf16)", "precision=choice(fp32,bf16)"),
        ("precision=sort(16,32)", "precision=sort(fp16,fp32)"),
        ("hydra.sweeper.params.precision=32,16", "hydra.sweeper.params.precision=fp32,fp16"),
        ("+precision=16", "+precision=fp16"),
        ("precision=8", "precision='8'"),  # no such option: quoted, so Hydra names it
        ("~precision=32", "~precision='32'"),  # deleting the choice as set: not renamed
        ("precision=bf16", "precision=bf16"),
        ("trainer.steps=16", "trainer.steps=16"),  # not a group
        ("model=gpt2_small", "model=gpt2_small"),  # a number inside a name
        ("precision=${oc.env:P}", "precision=${oc.env:P}"),  # an interpolation passes
        ("-m", "-m"),
    ],
)
def test_numbers_naming_a_group_option_become_its_name(arg, out):
    assert quote_numeric_choices([arg]) == [out]


def test_a_number_of_a_group_without_names_is_quoted():
    assert quote_numeric_choices(["strategy=3"]) == ["strategy='3'"]


def test_numbers_named_leaves_numbers_inside_names_and_longer_numbers():
    assert numbers_named("choice(32,gpt2,1.5,160)", NAMES) == "choice(fp32,gpt2,'1.5','160')"


def test_glob_over_precision_lists_each_option_once_by_name():
    assert quote_numeric_choices(["precision=glob(*)"]) == ["precision=bf16,fp16,fp32"]
    assert quote_numeric_choices(["precision=glob(*,exclude=[16])"]) == ["precision=bf16,fp32"]  # 16 is fp16
    assert quote_numeric_choices(["precision=glob(*,exclude=fp16)"]) == ["precision=bf16,fp32"]
    assert quote_numeric_choices(["precision=glob(fp*)"]) == ["precision=fp16,fp32"]


def test_a_glob_that_matches_nothing_passes_to_hydra_unchanged():
    assert quote_numeric_choices(["precision=glob(nothing*)"]) == ["precision=glob(nothing*)"]
    assert quote_numeric_choices(["strategy=glob(*)"]) == ["strategy=glob(*)"]  # a group without number names


def test_point_dirname_drops_quotes_and_slashes():
    assert point_dirname("precision='8',model=a/b") == "precision=8,model=a_b"


def test_a_short_name_is_kept_whole_at_the_limit():
    name = "x" * MAX_DIRNAME
    assert point_dirname(name) == name


def test_a_long_name_is_cut_with_a_hash_of_the_whole():
    name = "trainer.steps=1," + "a" * 300
    out = point_dirname(name)
    assert len(out.encode()) == MAX_DIRNAME
    assert out.endswith("_" + hashlib.sha1(name.encode()).hexdigest()[:8])
    assert out.startswith(name[: MAX_DIRNAME - 9])
    assert point_dirname(name + "b") != out  # two long names differ by their hash


def test_a_long_name_is_never_cut_inside_a_character():
    out = point_dirname("é" * 150)  # 300 bytes
    assert len(out.encode()) <= MAX_DIRNAME
    out.encode().decode("utf-8")  # whole characters only


def test_the_cache_file_is_named_by_the_sources_and_lives_in_the_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDED_EXP_PLUGINS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = schemas_cache_file()
    assert path.startswith(str(tmp_path / "sharded_exp" / "schemas-")) and path.endswith(".json")
    monkeypatch.setenv("SHARDED_EXP_PLUGINS", "my.plugin")
    assert schemas_cache_file() is None


def test_a_query_reads_the_cache_file_and_a_run_imports_the_registries(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDED_EXP_PLUGINS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    typed = registry_schemas(query=False)
    assert "schema_strategy_fsdp" in typed and "schema_model_gpt" in typed and "schema_data_markov" in typed
    path = schemas_cache_file()
    with open(path, "w") as f:
        json.dump({"format": CACHE_FORMAT, "complete": True, "schemas": {"schema_strategy_mine": {
            "name": "MineConfig", "fields": [{"name": "name", "type": "str", "default": "mine"}]}}}, f)  # fmt: skip
    ((name, made),) = registry_schemas(query=True).items()
    assert name == "schema_strategy_mine" and made.__name__ == "MineConfig" and made().name == "mine"
    assert registry_schemas(query=False)["schema_strategy_fsdp"] is typed["schema_strategy_fsdp"]


@pytest.mark.parametrize("damage", ["{not json", "[]", "{}", '{"format": "3", "schemas": {}}', '{"format": "1"}'])
def test_a_cache_file_this_code_did_not_write_whole_is_read_as_none_and_written_again(tmp_path, monkeypatch, damage):
    monkeypatch.delenv("SHARDED_EXP_PLUGINS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = schemas_cache_file()
    (tmp_path / "sharded_exp").mkdir()
    with open(path, "w") as f:
        f.write(damage)
    from sharded_exp.strategies.ddp import DDPConfig

    made = registry_schemas(query=True)  # the registries imported, and the file written again
    assert made["schema_strategy_ddp"] is DDPConfig
    again = registry_schemas(query=True)  # now from the file: made again
    assert set(again) == set(made) and again["schema_strategy_ddp"] is not DDPConfig
    assert again["schema_strategy_ddp"].__name__ == "DDPConfig"


def test_a_corrupt_cache_file_falls_back_to_the_registries(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDED_EXP_PLUGINS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = schemas_cache_file()
    (tmp_path / "sharded_exp").mkdir()
    with open(path, "w") as f:
        f.write("{not json")
    assert "schema_strategy_ddp" in registry_schemas(query=True)


def test_compose_applies_overrides_and_numeric_choices():
    cfg = compose(["precision=16", "strategy=fsdp", "trainer.steps=7"])
    assert cfg.precision.name == "16" and cfg.strategy.name == "fsdp" and cfg.trainer.steps == 7
    assert compose(["precision=fp32"]).precision.name == "32"


def test_the_sweep_subdirectory_resolver_is_registered():
    from omegaconf import OmegaConf

    compose_mod.register_schemas()
    assert OmegaConf.create({"d": "${point_dirname:a/b}"}).d == "a_b"


def test_a_plugins_schema_is_registered_so_its_yaml_can_name_it(tmp_path, monkeypatch):
    """A model registered by a SHARDED_EXP_PLUGINS module brings its own schema: Hydra must
    know ``schema_model_<name>`` before the plugin's YAML (``- /schema_model_odd@_here_``) is
    composed, in training and in the planner alike (both compose through here)."""
    import sys

    from sharded_exp import compose as module
    from sharded_exp.models import MODELS

    (tmp_path / "odd_plugin.py").write_text(
        "from dataclasses import dataclass\n"
        "from sharded_exp.models import MODELS\n\n"
        "@dataclass\nclass OddConfig:\n    name: str = 'odd'\n    width: int = 3\n\n"
        "@MODELS.register('odd', config=OddConfig)\ndef build(cfg):\n    raise NotImplementedError\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SHARDED_EXP_PLUGINS", "odd_plugin")
    monkeypatch.setattr(MODELS, "_entries", dict(MODELS._entries))
    monkeypatch.delitem(sys.modules, "odd_plugin", raising=False)
    nodes = module.registry_schemas()
    assert nodes["schema_model_odd"].__name__ == "OddConfig"
    sys.modules.pop("odd_plugin", None)


@pytest.mark.parametrize("preset", ["gpt_7b", "hf_llama_7b"])
def test_the_7b_presets_plan_bf16_unless_the_command_line_says_otherwise(preset):
    # Nobody trains a 7B model in fp32 (issue 48): the preset picks bf16, the command line wins.
    assert str(compose([f"model={preset}"]).precision.name) == "bf16"
    assert str(compose([f"model={preset}", "precision=32"]).precision.name) == "32"
    assert str(compose(["model=gpt"]).precision.name) == "32"
