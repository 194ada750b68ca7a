"""The package as a user installs it: a wheel into a fresh venv, the console scripts from an
empty directory, Hydra's questions, tab completion and a config directory of one's own."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT

pytestmark = pytest.mark.slow


def sh(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: {proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def install_torch(pip: list[str], tmp: Path) -> None:
    """torch as scripts/setup.sh installs it: the CPU wheel on local disk, else the CPU index."""
    version = "2.13.0"
    wheels = tmp / "torch_wheel"
    got = subprocess.run([*pip, "download", "-q", "--no-deps", "--no-index", "-d", wheels, f"torch=={version}"],
                         capture_output=True, timeout=300)  # fmt: skip
    if got.returncode == 0:
        sh([*pip, "install", "-q", *glob.glob(str(wheels / "torch-*.whl"))], tmp)
    else:
        sh([*pip, "install", "-q", f"torch=={version}", "--index-url", "https://download.pytorch.org/whl/cpu"], tmp)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("install")
    # Built from a copy of the sources: a build/ left in the checkout would be packaged stale,
    # and the checkout stays as it was.
    leave = shutil.ignore_patterns(".git", ".venv*", "build", "outputs", "*.egg-info", "__pycache__", ".*cache")
    shutil.copytree(ROOT, tmp / "src", ignore=leave, symlinks=True)
    sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp / "dist", tmp / "src"], tmp)
    (wheel,) = glob.glob(str(tmp / "dist" / "sharded_exp-*.whl"))
    sh([sys.executable, "-m", "venv", tmp / "venv"], tmp)
    pip = [str(tmp / "venv" / "bin" / "python"), "-m", "pip"]
    install_torch(pip, tmp)
    sh([*pip, "install", "-q", wheel], tmp)
    return tmp / "venv"


def user_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": f"{venv / 'bin'}:{env['PATH']}", "WANDB_SILENT": "true"}


def test_wheel_runs_the_default_job_from_an_empty_directory(fresh_venv, tmp_path):
    env = user_env(fresh_venv)
    where = sh([fresh_venv / "bin" / "python", "-c", "import sharded_exp; print(sharded_exp.__file__)"], tmp_path, env)
    assert str(fresh_venv) in where.stdout, "the fresh venv must run its installed copy, not the checkout"
    requires = sh([fresh_venv / "bin" / "python", "-c", "import importlib.metadata as m; print(m.requires('sharded_exp'))"],
                  tmp_path, env).stdout  # fmt: skip
    assert "torch>=2.11" in requires and "==" not in requires.split("extra")[0]

    sh([fresh_venv / "bin" / "sharded-exp", "trainer.steps=4", "trainer.warmup_steps=1"], tmp_path, env)
    (result_file,) = glob.glob(str(tmp_path / "outputs" / "runs" / "*" / "result.json"))
    result = json.loads(Path(result_file).read_text())
    assert result["status"] == "ok" and result["steps"] == 4
    assert glob.glob(str(Path(result_file).parent / "wandb" / "offline-run-*")), "W&B offline by default"

    plan = sh(
        [fresh_venv / "bin" / "sharded-exp-plan", "model=gpt", "plan.world_sizes=[2]", "plan.format=json"],
        tmp_path,
        env,
    )
    assert {r["strategy"] for r in json.loads(plan.stdout)["rows"]} >= {"ddp", "fsdp"}

    # The docs come with the wheel: --help points at them, sharded-exp-docs reads them.
    docs = sh([fresh_venv / "bin" / "sharded-exp-docs"], tmp_path, env).stdout
    assert str(fresh_venv) in docs and "getting-started/quickstart" in docs and "reference/config" in docs
    page = sh([fresh_venv / "bin" / "sharded-exp-docs", "quickstart"], tmp_path, env).stdout
    assert page.startswith("# Quickstart") and "debug=fast" in page


def test_questions_completion_and_your_own_config_dir(fresh_venv, tmp_path):
    env = user_env(fresh_venv)
    exe = fresh_venv / "bin" / "sharded-exp"
    t0 = time.perf_counter()
    help_text = sh([exe, "--help"], tmp_path, env).stdout
    help_s = time.perf_counter() - t0
    assert "strategy: ddp, fsdp, fsdp_grad_op, oss, sharded_ddp, zero1" in help_text
    assert "schema" not in help_text and "sharded-exp" in help_text
    assert "Docs: sharded-exp-docs" in help_text and "README" not in help_text
    assert not (tmp_path / "outputs").exists(), "--help made a run directory"
    print(f"sharded-exp --help: {help_s:.2f} s")

    for tool, says in (("sharded-exp-plan", "plan.world_sizes=[1,2,4,8,64]"), ("sharded-exp-report", "SWEEP_DIR")):
        assert says in sh([fresh_venv / "bin" / tool, "--help"], tmp_path, env).stdout, tool

    script = sh([exe, "-sc", "install=bash"], tmp_path, env).stdout
    assert script.rstrip().endswith("hydra_bash_completion sharded-exp")
    for line, expected in (("sharded-exp strat", "strategy="), ("sharded-exp strategy=fs", "strategy=fsdp_grad_op")):
        query = sh([exe, "-sc", "query=bash"], tmp_path, {**env, "COMP_LINE": line, "COMP_POINT": str(len(line))})
        assert expected in query.stdout.split(), (line, query.stdout)

    mine = tmp_path / "my_conf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "my_study.yaml").write_text(
        "# @package _global_\ntrainer:\n  steps: 3\n  warmup_steps: 1\n  world_size: 1\n"
    )
    cfg = sh([exe, "--config-dir", tmp_path / "my_conf", "experiment=my_study", "--cfg", "job"], tmp_path, env).stdout
    assert "world_size: 1" in cfg and "steps: 3" in cfg


def test_questions_read_the_schema_cache_without_importing_torch(tmp_path):
    """``--cfg job`` prints the same config from the schema cache as from the registries,
    and with the cache it never imports torch (tab completion asks at every TAB)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    ask = [sys.executable, "-X", "importtime", "-m", "sharded_exp", "--cfg", "job", "model=gpt", "strategy=fsdp"]
    cold = sh(ask, ROOT, env)
    assert list((tmp_path / "cache" / "sharded_exp").glob("schemas-*.json")), "a run of the registries writes the cache"
    warm = sh(ask, ROOT, env)
    assert warm.stdout == cold.stdout and "reshard_after_forward: true" in warm.stdout
    imported = lambda proc: {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "torch" in imported(cold) and "torch" not in imported(warm)


def test_setup_again_with_nothing_changed_installs_nothing():
    """scripts/setup.sh run a second time, on the .venv it made from these very files, answers
    from its stamp and calls no pip (CI's .ci/run has just made it)."""
    stamp = ROOT / ".venv" / ".setup-stamp"
    if not stamp.exists():
        pytest.skip(".venv was not made by scripts/setup.sh here (CI makes it so)")
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "setup: .venv is up to date" in proc.stdout and "| cuda" not in proc.stdout, proc.stdout  # no install
    assert stamp.exists()
