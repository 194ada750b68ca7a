"""Fixtures only (the helpers they use live in ``tests/helpers/``): jobs shared by the session, a
user's model module, full disks, an in-process gloo group; the check that every result.json
the suite wrote matches the published schema; and a watchdog that ends a test stuck in C code."""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys

import pytest

# Tests run on CPU (gloo), also on a GPU machine: trainer.accelerator=auto would otherwise
# take the CUDA path with one GPU per rank. The GPU checks are benchmarks/accuracy/gpu_check.py's.
# Set before torch looks at CUDA; inherited by the rank server, the ranks and subprocesses.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The suite writes bytecode (``__pycache__``, ignored by git) even where the environment says not
# to (PYTHONDONTWRITEBYTECODE=1 on this project's machines and CI): without it every xdist worker
# of every tier rewrote the asserts of all ~200 test modules again (collection 17.7 s a process,
# 5-7 s reading them back) and every `python -m ...` a test starts compiled the package anew.
# Set before the test modules and the package are imported; inherited by the workers and jobs.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from tests.helpers.jobs import ROOT, SharedRuns, saved_tiny_hf  # noqa: E402

WATCHDOG_S = 600
"""A test still running this long is stuck where no Python code runs: pytest-timeout's alarm (480 s,
pyproject) is Python and cannot fire while a C call holds the GIL, as when gloo's destructor
joins a thread that waits for it (this hung CI at stop 55). faulthandler's own C thread then
prints every thread's stack and ends the process: an xdist worker's test fails as "node down",
and the run goes on without it."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory)


@pytest.fixture(scope="session")
def ddp_reference(shared_runs):
    """The DDP run that a strategy's run with the same overrides is held against (shared)."""
    return lambda *overrides: shared_runs("strategy=ddp", *overrides)


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    # A test run under torchrun must not make in-process launches join its rendezvous.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SHARDED_EXP_FAULT"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def user_module(tmp_path):
    """A user's own model module (``tests/helpers/overrides.py``'s CUSTOM) importable as
    ``my_models`` by a job started with this environment."""
    import textwrap

    from tests.helpers.overrides import CUSTOM

    pkg = tmp_path / "user_code"
    pkg.mkdir()
    (pkg / "my_models.py").write_text(textwrap.dedent(CUSTOM))
    return {"PYTHONPATH": os.pathsep.join([str(pkg), str(ROOT)])}


@pytest.fixture(scope="session")
def placeholders(tmp_path_factory):
    """Resolves a covering run's placeholders (tests/helpers/covering.py) once per session, so
    that any test naming a covering run reaches the same shared run."""
    from tests.helpers.covering import DATA_FILES

    cache: dict[str, str] = {}

    def resolve(overrides: list[str]) -> list[str]:
        out = []
        for o in overrides:
            if "=__tmp__" in o:  # a directory of this test session
                key, name = o.split("=__tmp__")
                cache.setdefault(name, str(tmp_path_factory.mktemp(name)))
                o = f"{key}={cache[name]}"
            elif "=__data__" in o:  # a data file, made once per session
                key, name = o.split("=__data__")
                if name not in cache:
                    cache[name] = str(DATA_FILES[name](tmp_path_factory.mktemp("data") / name))
                o = f"{key}={cache[name]}"
            elif "=__saved__" in o:  # a tiny Hugging Face model written by save_pretrained
                key, kind = o.split("=__saved__")
                o = f"{key}={saved_tiny_hf(tmp_path_factory, kind)}"
            out.append(o)
        return out

    return resolve


@pytest.fixture
def small_fs(tmp_path):
    """A real filesystem of 1 MiB (tmpfs), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, timeout=60
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False, timeout=60)


@pytest.fixture
def gloo_group():
    """A real gloo process group of one rank in this process (an in-memory store): a
    strategy is built and stepped without spawning anything. Destroyed after the test (a
    fake step needs a process without one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_sessionfinish(session, exitstatus):
    """Every result.json the product wrote during the run (those with a ``schema_version``;
    tests also write hand-made ones) matches the published schema, docs/result.schema.json.
    A mismatch fails the session, naming the file and the key."""
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller checks every worker's files (its basetemp holds theirs)
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or exitstatus not in (0, 1):
        return
    import jsonschema

    from sharded_exp.job.result import SCHEMA_VERSION

    schema = json.loads((ROOT / "docs" / "result.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    checked, bad = 0, []
    for path in factory.getbasetemp().rglob("result.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a test's deliberately broken file
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            continue  # hand-made by a test: no version, or another sharded_exp's (the report refuses those)
        checked += 1
        for error in validator.iter_errors(data):
            bad.append(f"{path}: {'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message[:200]}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"result.json schema: {checked} file(s) the suite wrote checked, {len(bad)} mismatch(es)")
        for line in bad[:20]:
            reporter.write_line(f"  {line}")
    if bad:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
