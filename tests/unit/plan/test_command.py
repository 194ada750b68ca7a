"""sharded_exp/plan/command.py's pure parts: the checks of the planner's input
(:func:`check_plan`), Hydra's refusals said with their reason (:func:`composition_error`),
the model preset read from the command line (:func:`preset_of`), and a raw-count plan
printed in each format (:func:`plan`, analytic: no fake step)."""

from __future__ import annotations

import csv
import io
import json

import pytest
from omegaconf import OmegaConf

from sharded_exp.errors import ConfigError
from sharded_exp.plan import command


def with_values(cfg, **values):
    """A copy of ``cfg`` with ``plan.<key>`` (``__`` for a dot elsewhere) set."""
    c = cfg.copy()
    for key, value in values.items():
        OmegaConf.update(c, key.replace("__", ".") if "__" in key else f"plan.{key}", value)
    return c


# ------------------------------------------------------------------------ check_plan
@pytest.mark.parametrize(
    "values, message",
    [
        ({"params": -1.0}, "plan.params=-1.0 must be a finite number >= 1"),
        ({"params": 0.5}, "plan.params=0.5 must be a finite number >= 1"),
        ({"params": float("nan")}, "plan.params=nan must be a finite number >= 1"),
        ({"params": float("inf")}, "plan.params=inf must be a finite number >= 1"),
        ({"world_sizes": []}, "plan.world_sizes=[] must be a non-empty list of integers >= 1"),
        ({"world_sizes": [2, 0]}, "plan.world_sizes=[2, 0] must be a non-empty list of integers >= 1"),
        ({"world_sizes": [16385]}, "up to 16,384 ranks"),
        ({"device_memory_gib": 0.0}, "plan.device_memory_gib=0.0 must be a finite number > 0"),
        ({"device_memory_gib": float("inf")}, "plan.device_memory_gib=inf must be a finite number > 0"),
        ({"workers": -1}, "plan.workers=-1 must be >= 0"),
        ({"units": 0}, "plan.units=0 must be between 1 and 100,000"),
        ({"units": 10**9}, "plan.units=1000000000 must be between 1 and 100,000"),
        ({"strategies": ["ddp", "zero9"]}, "unknown strategy 'zero9'"),
        ({"levers": ["none", "ac+turbo"]}, "plan.levers entry 'ac+turbo': turbo is not a lever"),
        ({"levers": [""]}, "plan.levers entry '': empty is not a lever"),
        ({"plot": "plan.txt"}, "plan.plot=plan.txt must name a .png, .svg or .pdf file"),
        ({"find": "depth"}, "plan.find=depth needs a model with model.n_layers (e.g. model=gpt); model=mlp has none"),
        (
            {"find": "depth", "params": 1e9},
            "plan.find=depth needs a model with model.n_layers (e.g. model=gpt); "
            "a raw parameter count (plan.params) has none",
        ),  # fmt: skip
        ({"trainer__batch_size": 0}, "trainer.batch_size=0 must be >= 1"),
        ({"find": "batch_size", "params": 1e9}, "plan.find=batch_size needs a model: a raw parameter count"),
        ({"levers": ["ac+ac_selective"]}, "plan.levers entry 'ac+ac_selective' sets one lever twice"),
        ({"levers": ["ac+ac"]}, "plan.levers entry 'ac+ac' sets one lever twice"),
        ({"world_sizes": [8, 8]}, "plan.world_sizes names 8 twice"),
        ({"strategies": ["ddp", "ddp"]}, "plan.strategies names ddp twice"),
        ({"levers": ["offload"], "strategies": ["ddp", "zero1"]}, "has no FSDP strategy; add fsdp or fsdp_grad_op"),
        ({"levers": ["offload"], "device": "cpu"}, "plan.levers with offload and plan.device=cpu"),
        ({"plot": "/proc/x.png"}, "plan.plot=/proc/x.png: /proc cannot be written"),
        ({"alloc_conf": "expandable:True"}, "plan.alloc_conf='expandable:True': unknown option 'expandable'"),
        ({"alloc_conf": "max_split_size_mb:abc"}, "plan.alloc_conf='max_split_size_mb:abc'"),
    ],
)
def test_input_the_planner_refuses(plan_cfg, values, message):
    with pytest.raises(ConfigError) as refused:
        command.check_plan(with_values(plan_cfg, **values))
    assert message in str(refused.value)


def test_the_environments_allocator_settings_a_cuda_plan_falls_back_to_are_checked_before_it_fakes(
    plan_cfg, monkeypatch
):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segment:True")
    with pytest.raises(ConfigError) as refused:
        command.check_plan(with_values(plan_cfg, device="cuda"))
    assert str(refused.value).startswith(
        "PYTORCH_CUDA_ALLOC_CONF='expandable_segment:True' (from this environment: fix or unset it, or set "
        "plan.alloc_conf): unknown option 'expandable_segment'"
    )
    command.check_plan(with_values(plan_cfg, device="cuda", alloc_conf=""))  # the setting overrides it
    command.check_plan(with_values(plan_cfg, device="cpu"))  # a CPU plan has no caching allocator to read it for
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:abc")  # torch's newer name, read second
    with pytest.raises(ConfigError, match="^PYTORCH_ALLOC_CONF='max_split_size_mb:abc' "):
        command.check_plan(with_values(plan_cfg, device="cuda"))


def test_input_the_planner_takes(plan_cfg, gpt_cfg, tmp_path):
    command.check_plan(plan_cfg)
    command.check_plan(with_values(plan_cfg, world_sizes=[1, command.MAX_FAKED_RANKS]))
    command.check_plan(with_values(plan_cfg, params=1.0, world_sizes=[10**6]))  # a raw count extrapolates
    command.check_plan(with_values(plan_cfg, levers=["none", "ac+offload", "ac_selective"], workers=0, units=1))
    command.check_plan(with_values(gpt_cfg, find="depth"))
    command.check_plan(with_values(plan_cfg, plot=str(tmp_path / "not" / "yet" / "plan.PNG")))
    command.check_plan(with_values(plan_cfg, alloc_conf="expandable_segments:True,max_split_size_mb:512"))
    command.check_plan(with_values(plan_cfg, alloc_conf=""))  # torch's defaults


def test_a_model_chosen_beside_a_raw_count_is_refused(plan_cfg):
    c = with_values(plan_cfg, params=1e9)
    with pytest.raises(ConfigError, match="plan.params=1e\\+09 plans a raw parameter count, and model=gpt "
                                         "\\+model.n_layers=2 would be ignored"):  # fmt: skip
        command.check_plan(c, ["model=gpt", "+model.n_layers=2", "plan.units=4"])
    command.check_plan(c, ["plan.units=4", "trainer.batch_size=2"])


def test_a_plot_must_be_a_file_in_a_directory(plan_cfg, tmp_path):
    (tmp_path / "plan.png").mkdir()
    with pytest.raises(ConfigError, match="must name a .png, .svg or .pdf file"):
        command.check_plan(with_values(plan_cfg, plot=str(tmp_path / "plan.png")))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'a_file'} is a file, not a directory"):
        command.check_plan(with_values(plan_cfg, plot=str(tmp_path / "a_file" / "below" / "plan.svg")))


# ---------------------------------------------------------------- composition_error
class Refusal(Exception):
    """What Hydra keeps as an override error's cause (OmegaConf's, with the key)."""

    def __init__(self, text, full_key=None):
        super().__init__(text)
        self.full_key = full_key


def hydra_error(text, cause=None):
    exc = Exception(text)
    exc.__cause__ = cause
    return exc


def test_a_world_size_that_is_no_integer_is_said_as_the_planner_says_it():
    exc = hydra_error("Error merging override plan.world_sizes=[2.5]", Refusal("not an int", "plan.world_sizes[0]"))
    argv = ["plan.world_sizes=[1]", "plan.units=2", "plan.world_sizes=[2.5]"]
    assert command.composition_error(exc, argv) == "plan.world_sizes=[2.5] " + command.WORLD_SIZES
    exc = hydra_error("Error merging", Refusal("not a list", "plan.world_sizes"))
    assert command.composition_error(exc, ["+plan.world_sizes=4"]) == "plan.world_sizes=4 " + command.WORLD_SIZES
    assert command.composition_error(exc, []) == "plan.world_sizes=? " + command.WORLD_SIZES


def test_another_refusal_is_said_with_the_first_line_of_its_reason():
    exc = hydra_error("Error merging override plan.units=x", Refusal("Value 'x' is no Integer\n  full_key: plan.units",
                                                                     "plan.units"))  # fmt: skip
    assert command.composition_error(exc, []) == "Error merging override plan.units=x: Value 'x' is no Integer"


def test_a_refusal_whose_reason_it_already_says_is_said_once():
    exc = hydra_error("Could not override 'plan.x': no key x", Refusal("no key x"))
    assert command.composition_error(exc, []) == "Could not override 'plan.x': no key x"
    assert command.composition_error(hydra_error("plain"), []) == "plain"
    assert command.composition_error(hydra_error("plain", Refusal("")), []) == "plain"


# ------------------------------------------------------------------------- preset_of
def test_the_preset_is_the_last_model_chosen_with_the_keys_changed():
    assert command.preset_of([]) == "mlp"
    assert command.preset_of(["trainer.batch_size=1"]) == "mlp"
    assert command.preset_of(["model=gpt", "plan.units=2", "model=gpt_7b", "model.n_layers=80"]) == (
        "gpt_7b model.n_layers=80"
    )
    assert command.preset_of(["model=custom", "model._target_=pkg.build", "+model.hidden=64"]) == (
        "custom model._target_=pkg.build +model.hidden=64"  # the run needs the + too
    )
    assert command.preset_of(["model.d_model=64"]) == "mlp model.d_model=64"


# ------------------------------------------------------------------------------ plan
def _raw(plan_cfg, form):
    return with_values(plan_cfg, params=1e9, world_sizes=[8, 64], strategies=["ddp", "fsdp"], format=form,
                       device="cpu")  # fmt: skip


def test_a_raw_count_planned_as_csv_has_a_row_per_point(plan_cfg, capsys):
    assert command.plan(_raw(plan_cfg, "csv"), "mlp") == 0
    out, err = capsys.readouterr()
    lines = list(csv.reader(io.StringIO(out)))
    assert [line[:3] for line in lines] == [
        ["strategy", "levers", "ranks"],
        ["ddp", "none", "8"],
        ["ddp", "none", "64"],
        ["fsdp", "none", "8"],
        ["fsdp", "none", "64"],
    ]
    assert [line.split()[1] for line in err.splitlines() if line.startswith("plan: ")] == ["2/4", "4/4"]


def test_a_raw_count_planned_as_json_names_what_was_planned(plan_cfg, capsys):
    assert command.plan(_raw(plan_cfg, "json"), "mlp") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["params"] == 10**9 and doc["model"] is None and doc["device"] == "cpu"
    assert doc["cheapest"] == [] and doc["found"] == []
    assert doc["columns"]["peak"] == "total_gib" and len(doc["rows"]) == 4


def test_a_raw_count_planned_as_a_table_says_its_count(plan_cfg, capsys):
    assert command.plan(_raw(plan_cfg, "md"), "mlp") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: raw parameter count 1.00 B params in 32 units")
    assert any(line.startswith("| ddp") for line in out)


@pytest.mark.parametrize("world_sizes", [[1], [3], [4, 5]])
def test_a_layout_training_refuses_is_refused_for_every_world_size_planned(world_sizes):
    from sharded_exp.compose import compose

    cfg = compose(["strategy=fsdp", "strategy.replicate=2", f"plan.world_sizes={world_sizes}"], config_name="plan")
    with pytest.raises(ConfigError) as refused:
        command.check_plan(cfg)
    bad = next(ws for ws in world_sizes if ws % 2)
    assert f"at {bad} ranks, strategy.replicate=2 must divide trainer.world_size={bad}" in str(refused.value)
    command.check_plan(compose(["strategy=fsdp", "strategy.replicate=2", "plan.world_sizes=[2,8]"], config_name="plan"))


def test_a_model_fsdp_cannot_wrap_is_refused_for_a_plan_of_fsdp(monkeypatch):
    import torch

    from sharded_exp.compose import compose
    from sharded_exp.plan import command as cmd
    from sharded_exp.predict import prediction

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
            self.blocks[1].weight = self.blocks[0].weight

        def sharding_units(self):
            return list(self.blocks)

    monkeypatch.setattr(prediction, "meta_model", lambda cfg, freeze=(): Tied())
    with pytest.raises(ConfigError, match=r"strategy=fsdp: model=mlp's parameter blocks.1.weight is also blocks.0"):
        cmd.buildable(compose(["plan.strategies=[ddp,fsdp]"], config_name="plan"))
    cmd.buildable(compose(["plan.strategies=[ddp,zero1]"], config_name="plan"))  # FSDP not planned: no refusal


def test_a_refusal_a_fake_step_finds_ends_the_plan_with_exit_2_and_no_traceback(plan_cfg, capsys):
    """A model whose forward registers a parameter builds fine; its fake step refuses it."""
    from sharded_exp.compose import compose

    cfg = compose(["model=custom", "model._target_=tests.helpers.user_models.build_parameter_in_forward",
                   "plan.strategies=[ddp]", "plan.world_sizes=[2]", "plan.device=cpu"], config_name="plan")  # fmt: skip
    assert command.plan(cfg, "custom") == 2
    err = capsys.readouterr().err
    assert "error: model=custom: its forward creates the parameter late_scale" in err and "Traceback" not in err


def test_this_gpu_is_refused_for_a_cuda_plan_on_a_machine_without_one(plan_cfg, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="plan.device_profile=this with plan.device=cuda prices the step on this"):
        command.check_plan(with_values(plan_cfg, device="cuda", device_profile="this"))
    command.check_plan(with_values(plan_cfg, device="cpu", device_profile="this"))
    command.check_plan(with_values(plan_cfg, device="cuda", device_profile="h100_sxm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    command.check_plan(with_values(plan_cfg, device="cuda", device_profile="this"))
