"""The planner speaks like the trainer: Hydra's questions answered without torch, a table a
person reads, and the same columns in every format."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.jobs import ROOT, run_cli

PLAN = ["model=gpt", "model.n_layers=2", "plan.world_sizes=[2]", "plan.strategies=[ddp,fsdp]", "plan.device=cpu"]


def ask(args, env):
    cmd = [sys.executable, "-X", "importtime", "-m", "sharded_exp.plan", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    return proc.stdout, imported


def test_hydra_questions_are_answered_without_torch(tmp_path):
    """--help, --cfg job, --info and shell completion, from the schema cache (written by the
    first question that finds none), never importing torch once it is there."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cold, imported = ask(["--cfg", "job", "model=gpt_7b", "plan.world_sizes=[8,64]"], env)
    assert "torch" in imported  # no cache yet: the registries were imported, and the cache written
    job, imported = ask(["--cfg", "job", "model=gpt_7b", "plan.world_sizes=[8,64]"], env)
    assert job == cold and "torch" not in imported
    assert "d_model: 4096" in job and "world_sizes:\n  - 8\n  - 64" in job and "params: null" in job
    text, imported = ask(["--help"], env)
    assert "torch" not in imported
    from sharded_exp.config import PlanSettings

    for name in PlanSettings.__dataclass_fields__:  # every plan setting named, with its default
        assert f"plan.{name}=" in text, name
    assert "plan.params=null" in text and "plan.world_sizes=[1,2,4,8,64]" in text
    assert "``" not in text and ":mod:" not in text and "None" not in text  # plain text, null not None
    info, imported = ask(["--info", "defaults"], env)
    assert "torch" not in imported and "plan" in info
    script, imported = ask(["-sc", "install=bash"], env)
    assert "torch" not in imported and "hydra_bash_completion" in script
    line = "sharded-exp-plan plan.dev"
    proc = subprocess.run([sys.executable, "-m", "sharded_exp.plan", "-sc", "query=bash"], cwd=ROOT,
                          env={**env, "COMP_LINE": line, "COMP_POINT": str(len(line))}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "plan.device=" in proc.stdout.split(), proc.stdout + proc.stderr


@pytest.mark.slow  # unit: tests/unit/plan/test_table.py
def test_every_format_has_the_same_columns(capsys):
    """table (aligned, plan.columns=all), md, csv and json: one plan, the same columns; the
    header names the model preset, sequence, precision, optimizer, per-rank batch and budget,
    the method once. The default table (plan.columns=short) fits 100 characters a line."""
    from sharded_exp.plan import command

    out = {}
    for form in ("table", "md", "csv", "json"):
        assert command.main([*PLAN, f"plan.format={form}", "plan.columns=all"]) == 0
        out[form] = capsys.readouterr().out
    assert command.main(PLAN) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 100
    doc = json.loads(out["json"])
    columns = list(doc["columns"])
    assert columns[:3] == ["strategy", "levers", "ranks"] and "peak" in columns and "mean" in columns
    assert "optim state" in columns and "buckets" in columns  # named as the report names them
    rows = list(csv.reader(io.StringIO(out["csv"])))
    assert rows[0][: len(columns)] == columns and len(rows) == 1 + len(doc["rows"])
    for form in ("table", "md"):
        lines = out[form].splitlines()
        head = next(line for line in lines if line.lstrip("| ").startswith("strategy"))
        assert head.replace("|", " ").split()[:3] == ["strategy", "levers", "ranks"], head
        for c in columns:
            assert c in head, (form, c)
        assert sum(line.startswith("method") for line in lines) >= 1  # said above the table, not per row
        first = lines[0]
        for said in ("model=gpt model.n_layers=2", "sequence 64", "precision 32", "optimizer adam",
                     "batch 32 per rank", "device budget 80 GiB"):  # fmt: skip
            assert said in first, (said, first)
    table = out["table"].splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("strategy"))
    rule = table[head + 1]  # the dashes under each heading: the columns' spans
    gaps = [i for i, ch in enumerate(rule) if ch == " "]
    for line in table[head : head + 2 + len(doc["rows"])]:  # aligned: nothing crosses a gap
        assert all(i >= len(line) or line[i] == " " for i in gaps), line
    for key, r in zip(doc["columns"].values(), doc["rows"]):
        assert key in r
    ddp = next(r for r in rows[1:] if r[0] == "ddp")
    ddp_json = next(r for r in doc["rows"] if r["strategy"] == "ddp")
    assert float(ddp[columns.index("peak")]) == pytest.approx(ddp_json["total_gib"], rel=1e-5)


def test_the_optimizer_state_apart_from_the_steps_temporaries():
    """DDP under foreach Adam: the state is two moments (8 bytes per parameter), and the
    step's temporaries (sqrt of the second moment of the group it steps) apart from it."""
    from sharded_exp.compose import compose
    from sharded_exp.plan import points
    from tests.helpers.overrides import DEEP

    cfg = compose([*DEEP, "plan.strategies=[ddp]"], "plan")
    (row,) = points.plan_rows(cfg, [2], "cuda")
    assert row["optimizer_gib"] == pytest.approx(2 * row["params_gib"], rel=1e-3)
    # sqrt(v) of the largest parameter group (the decayed weights: all but the norms and biases)
    assert 0.95 * row["params_gib"] < row["optimizer_step_gib"] <= row["params_gib"]


def test_progress_is_a_line_per_point_in_a_log(capsys):
    from sharded_exp.plan import command

    assert command.main(PLAN) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in err if line.startswith("plan: ")] == ["1/2", "2/2"]
    assert "s left" in err[0]


# ---------------------------- input the planner refuses, and a 0-dim parameter it takes
@pytest.mark.parametrize(
    "override, message",
    [
        ("plan.params=-1", "plan.params=-1.0 must be a finite number >= 1"),
        ("plan.params=nan", "plan.params=nan must be a finite number >= 1"),
        ("plan.world_sizes=[0]", "plan.world_sizes=[0] must be a non-empty list of integers >= 1"),
        ("plan.worldsizes=[2]", "plan.worldsizes is not a setting of this config; did you mean plan.world_sizes?"),
        ("strategy=zero9", "strategy=zero9 is not an option of strategy; did you mean strategy=zero1?"),
        ("plan.strategies=[zero9]", "unknown strategy 'zero9'"),
        ("plan.format=xml", "plan.format=xml"),
        ("plan.plot=plan.txt", "plan.plot=plan.txt must name a .png, .svg or .pdf file"),
    ],
)
@pytest.mark.slow
def test_the_planner_refuses_bad_input_with_exit_2(override, message):
    proc = run_cli([override], cwd=ROOT, module="sharded_exp.plan")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "override, message",
    [
        ("plan.world_sizes=[2.5]", "error: plan.world_sizes=[2.5] must be a non-empty list of integers >= 1\n"),
        ("plan.world_sizes=4", "error: plan.world_sizes=4 must be a non-empty list of integers >= 1\n"),
        ("plan.units=x", "error: Error merging override plan.units=x: Value 'x' of type 'str' could not be converted "
                         "to Integer\n"),
    ],
)  # fmt: skip
def test_a_value_hydra_refuses_is_said_with_its_reason(override, message, capsys):
    """Hydra keeps why it refused an override in the exception's cause: the planner says it
    (a world size that is no integer as one below 1 is said), in this process, before any plan."""
    from sharded_exp.plan import command

    assert command.main([override]) == 2
    assert capsys.readouterr().err == message


def test_a_model_beside_plan_params_is_refused(capsys):
    """In this process, without a second torch start-up (a traceback would fail the test;
    ``python -m sharded_exp.plan`` exits with what main returns): exit 2 and the reason."""
    from sharded_exp.plan import command

    assert command.main(["model=gpt2_small", "plan.params=1e9"]) == 2
    err = capsys.readouterr().err
    assert "plan.params=1e+09 plans a raw parameter count, and model=gpt2_small would be ignored" in err, err


def test_the_planner_takes_a_0_dim_parameter(capsys):
    """In this process: an IndexError on the 0-dim parameter would fail the test."""
    from sharded_exp.plan import command

    assert command.main(["model=custom", "model._target_=tests.helpers.user_models.build_with_scalar",
                         "plan.world_sizes=[2]", "plan.strategies=[fsdp,fsdp_grad_op]"]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert "fsdp_grad_op" in out.out and "IndexError" not in out.err, out.err[-3000:]


def test_planner_input_refused_before_planning(tmp_path, capsys):
    """Refused at once with exit 2 and one line: a model that cannot be built, more ranks than a
    model is faked at, a plot path under a file (said before the planning, not after)."""
    from sharded_exp.plan import command

    (tmp_path / "a_file").write_text("")
    cases = {
        "model._target_=tests.helpers.user_models.build_none": "returned None (does it return the model?)",
        "plan.world_sizes=[1000000]": "up to 16,384 ranks",
        f"plan.plot={tmp_path / 'a_file' / 'plan.png'}": f"{tmp_path / 'a_file'} is a file, not a directory",
        "trainer.freeze=[*]": "model=gpt has nothing to train",
    }
    for override, message in cases.items():
        model = ["model=custom"] if "_target_" in override else ["model=gpt"]
        ranks = [] if "world_sizes" in override else ["plan.world_sizes=[2]"]
        assert command.main([*model, *ranks, override]) == 2
        assert message in capsys.readouterr().err, override
    # a raw parameter count extrapolates beyond the limit
    assert command.main(["plan.params=1e9", "plan.world_sizes=[1000000]", "plan.format=csv"]) == 0
