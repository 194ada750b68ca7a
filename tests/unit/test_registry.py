"""sharded_exp.registry: a name maps to a builder and its config; a duplicate or unknown
name is refused naming the registered ones; plugins named in SHARDED_EXP_PLUGINS are imported."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from sharded_exp.errors import ConfigError
from sharded_exp.registry import PLUGINS_ENV, Registry, import_plugins


@dataclass
class Conf:
    x: int = 1


def test_a_registered_builder_and_config_are_found_by_name():
    reg = Registry("widget")

    @reg.register("b", config=Conf)
    def build_b():
        return "b"

    assert reg.builder("b") is build_b and reg.config_class("b") is Conf
    assert build_b() == "b"  # the decorator returns the builder itself


def test_the_config_defaults_to_the_builders_own_config_class():
    reg = Registry("strategy")

    @reg.register("mine")
    class Mine:
        Config = Conf

    assert reg.config_class("mine") is Conf and reg.builder("mine") is Mine


def test_names_are_sorted():
    reg = Registry("widget")
    for name in ("zeta", "alpha", "mu"):
        reg.register(name, config=Conf)(lambda: None)
    assert reg.names() == ["alpha", "mu", "zeta"]


def test_a_name_registered_twice_is_an_error():
    reg = Registry("model")
    reg.register("a", config=Conf)(lambda: None)
    with pytest.raises(KeyError, match="model 'a' is registered twice"):
        reg.register("a", config=Conf)(lambda: None)


def test_an_unknown_name_is_refused_naming_the_registered_ones():
    reg = Registry("data")
    reg.register("teacher", config=Conf)(lambda: None)
    reg.register("markov", config=Conf)(lambda: None)
    for lookup in (reg.builder, reg.config_class):
        with pytest.raises(ConfigError, match="unknown data 'nope'; registered: markov, teacher$"):
            lookup("nope")


def test_plugins_named_in_the_environment_are_imported(tmp_path, monkeypatch):
    (tmp_path / "unit_plugin_one.py").write_text("LOADED = True\n")
    (tmp_path / "unit_plugin_two.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, " unit_plugin_one, ,unit_plugin_two ,")
    try:
        import_plugins()
        assert sys.modules["unit_plugin_one"].LOADED and sys.modules["unit_plugin_two"].LOADED
    finally:
        sys.modules.pop("unit_plugin_one", None)
        sys.modules.pop("unit_plugin_two", None)


def test_no_plugins_imports_nothing(monkeypatch):
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    import_plugins()
    monkeypatch.setenv(PLUGINS_ENV, "")
    import_plugins()


def test_a_plugin_that_cannot_be_imported_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, "json,no_such_plugin_module_xyz")
    with pytest.raises(ConfigError, match=f"{PLUGINS_ENV} names the module 'no_such_plugin_module_xyz'"):
        import_plugins()
