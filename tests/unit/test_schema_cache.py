"""sharded_exp.schema_cache: the registries' schemas written as JSON and made again, so that the
command line composes with the same keys, types, defaults and refusals without importing torch."""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from typing import Any, Dict, List, Optional

import pytest
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sharded_exp.compose import registry_schemas
from sharded_exp.schema_cache import describe, rebuild, rebuild_all


class Colour(enum.Enum):
    red = "red"
    blue = "blue"


@dataclasses.dataclass
class Inner:
    depth: int = 2


@dataclasses.dataclass
class Every:
    """One field of every kind a schema may hold."""

    name: str = "every"
    count: int = 3
    rate: float = 0.5
    on: bool = True
    anything: Any = None
    colour: Colour = Colour.blue
    maybe_colour: Optional[Colour] = None
    maybe_text: Optional[str] = None
    names: List[str] = dataclasses.field(default_factory=lambda: ["a", "b"])
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)
    inner: Inner = dataclasses.field(default_factory=Inner)
    must: int = MISSING


def made(cls: type) -> type:
    return rebuild(json.loads(json.dumps(describe(cls))))  # through JSON, as the cache file holds it


def refusal(cls: type, key: str, value: Any) -> str:
    with pytest.raises(OmegaConfBaseException) as err:
        OmegaConf.merge(OmegaConf.structured(cls), {key: value})
    return str(err.value).replace(cls.__qualname__, cls.__name__)  # the same name, a local class or not


def test_every_kind_of_field_is_made_again_with_its_name_type_and_default():
    again = made(Every)
    assert again.__name__ == "Every"
    assert OmegaConf.to_yaml(OmegaConf.structured(again)) == OmegaConf.to_yaml(OmegaConf.structured(Every))
    node = OmegaConf.structured(again)
    assert OmegaConf.is_missing(node, "must") and node.inner.depth == 2 and node.colour.name == "blue"
    node.names.append("c")  # a default list is each instance's own
    assert OmegaConf.structured(again).names == ["a", "b"]


@pytest.mark.parametrize(
    "key, value",
    [("count", "abc"), ("rate", "fast"), ("on", "maybe"), ("colour", "green"), ("maybe_colour", "green"),
     ("names", "not a list"), ("inner", {"depth": "deep"}), ("unknown", 1)],
)  # fmt: skip
def test_a_made_schema_refuses_what_the_original_refuses_with_the_same_message(key, value):
    assert refusal(made(Every), key, value) == refusal(Every, key, value)


def test_a_made_schema_takes_what_the_original_takes():
    values = {"count": "7", "colour": "red", "maybe_colour": None, "names": ["x"], "extra": {"k": 1}, "must": 4}
    ours = OmegaConf.merge(OmegaConf.structured(made(Every)), values)
    theirs = OmegaConf.merge(OmegaConf.structured(Every), values)
    assert OmegaConf.to_container(ours, enum_to_str=True) == OmegaConf.to_container(theirs, enum_to_str=True)


def test_a_type_the_cache_cannot_hold_is_said():
    @dataclasses.dataclass
    class Odd:
        pair: tuple = (1, 2)

    with pytest.raises(TypeError, match="cannot hold"):
        describe(Odd)


def test_every_registry_schema_is_made_again_exactly():
    for name, cls in registry_schemas(query=False).items():
        again = made(cls)
        assert again.__name__ == cls.__name__, name
        real, ours = OmegaConf.structured(cls), OmegaConf.structured(again)
        assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(real), name
        for field in dataclasses.fields(cls):  # the same node type for each field: the same checks
            assert type(ours._get_node(field.name)) is type(real._get_node(field.name)), (name, field.name)


def test_declared_bounds_are_made_again_and_refuse_the_same_values_with_the_same_message():
    """A registry schema's bounds (sharded_exp.config.bounded) travel in the cache, so the
    command line refuses an out-of-range value before torch is imported, as pre-flight does
    with the real schema: the same values, the same words."""
    from sharded_exp.config import check_bounds
    from sharded_exp.errors import ConfigError

    schemas = registry_schemas(query=False)
    for name, group, key, bad in [("gpt", "model", "n_heads", 3), ("fsdp", "strategy", "replicate", 0),
                                  ("ddp", "strategy", "bucket_cap_mb", -1.0), ("sharded_ddp", "strategy", "reduce_buffer_size", -5),
                                  ("token_classification", "data", "min_len", 1.5), ("teacher", "data", "teacher_hidden", 0)]:  # fmt: skip
        cls = schemas[f"schema_{group}_{name}"]
        again = made(cls)
        assert {f.name: dict(f.metadata) for f in dataclasses.fields(again)} == {
            f.name: dict(f.metadata) for f in dataclasses.fields(cls)
        }, name
        said = []
        for schema in (cls, again):
            node = OmegaConf.merge(OmegaConf.structured(schema), {key: bad})
            check_bounds(group, OmegaConf.structured(schema), schema)  # the defaults are within bounds
            with pytest.raises(ConfigError) as err:
                check_bounds(group, node, schema)
            said.append(str(err.value))
        assert said[0] == said[1] and f"{key}=" in said[0], said


def test_an_enum_two_fields_share_is_one_class_made_again_and_reads_as_its_name():
    """FSDP's param_dtype and reduce_dtype share DType: made again, still one class (so that
    ``reduce_dtype=${strategy.param_dtype}`` resolves), an Option as the original is (a member
    reads as its name in a string)."""
    from sharded_exp.config import Option
    from sharded_exp.strategies.fsdp import FSDPConfig

    schemas = rebuild_all(json.loads(json.dumps({"fsdp": describe(FSDPConfig)})))
    hints = typing.get_type_hints(schemas["fsdp"])
    param, reduce = (typing.get_args(hints[k])[0] for k in ("param_dtype", "reduce_dtype"))
    assert param is reduce and issubclass(param, Option) and f"{param['bfloat16']}" == "bfloat16"
    node = OmegaConf.structured(schemas["fsdp"])
    node.param_dtype = "bfloat16"
    node.reduce_dtype = "${param_dtype}"
    assert node.reduce_dtype == param["bfloat16"]


def test_a_data_tasks_declared_needs_are_made_again_and_refuse_the_same_model_with_the_same_message():
    """What a data task feeds (sharded_exp.config.check_fed) travels in the cache: the command
    line refuses ``model=gpt data=teacher`` before torch, with pre-flight's words. A task whose
    needs depend on its settings (a file's data.kind) declares none, here as there."""
    from sharded_exp.config import check_fed
    from sharded_exp.errors import ConfigError

    schemas = registry_schemas(query=False)
    gpt = OmegaConf.structured(schemas["schema_model_gpt"])
    mlp = OmegaConf.structured(schemas["schema_model_mlp"])
    for task, needs, fit, unfit in [("teacher", ("in_features", "num_classes"), mlp, gpt),
                                    ("markov", ("vocab_size", "seq_len"), gpt, mlp),
                                    ("causal_lm", ("vocab_size", "seq_len"), gpt, mlp)]:  # fmt: skip
        cls = schemas[f"schema_data_{task}"]
        again = made(cls)
        assert again.MODEL_FIELDS == cls.MODEL_FIELDS == needs and again.FEEDS == cls.FEEDS, task
        said = []
        for schema in (cls, again):
            check_fed(OmegaConf.structured(schema), fit)
            with pytest.raises(ConfigError) as err:
                check_fed(OmegaConf.structured(schema), unfit)
            said.append(str(err.value))
        assert said[0] == said[1] and said[0].startswith(f"data={task} feeds {cls.FEEDS}, not model="), said
    # a file dataset: its needs per data.kind (hf_dataset), made again as mappings
    hf = schemas["schema_data_hf_dataset"]
    assert made(hf).MODEL_FIELDS == hf.MODEL_FIELDS and made(hf).FEEDS == hf.FEEDS
    token = OmegaConf.merge(OmegaConf.structured(made(hf)), {"kind": "token_classification"})
    with pytest.raises(ConfigError, match="data=hf_dataset feeds token classifiers .*model=gpt has no num_labels"):
        check_fed(token, gpt)
    check_fed(OmegaConf.structured(made(hf)), gpt)  # causal_lm: gpt has vocab_size and seq_len


def test_a_strategys_packages_are_made_again_and_refused_with_the_same_message(monkeypatch):
    """The packages a strategy needs (sharded_exp.config.check_packages) travel in the cache: the
    command line refuses ``strategy=oss`` without fairscale before torch, with pre-flight's words."""
    from sharded_exp import config
    from sharded_exp.errors import ConfigError

    schemas = registry_schemas(query=False)
    for name in ("oss", "sharded_ddp"):
        cls = schemas[f"schema_strategy_{name}"]
        again = made(cls)
        assert again.REQUIRES == cls.REQUIRES == ("fairscale",), name
    assert "REQUIRES" not in describe(schemas["schema_strategy_ddp"])
    monkeypatch.setattr(config, "missing_packages", lambda names: list(names))  # as if none were installed
    said = []
    for schema in (schemas["schema_strategy_oss"], made(schemas["schema_strategy_oss"])):
        with pytest.raises(ConfigError) as err:
            config.check_packages(OmegaConf.structured(schema))
        said.append(str(err.value))
    assert (
        said[0]
        == said[1]
        == (
            "strategy=oss needs the package(s) fairscale, which are not installed here (pip install -e . installs them)"
        )
    )
    config.check_packages(OmegaConf.structured(schemas["schema_strategy_ddp"]))  # none declared: nothing to miss
