"""Shared helpers: compose the real config tree, run real jobs (real ranks, real gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sharded_exp.compose import compose
from sharded_exp.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]

# Tests run on CPU (gloo), also on a GPU machine: trainer.accelerator=auto would otherwise
# take the CUDA path with one GPU per rank. The GPU checks are benchmarks/gpu_check.py's.
# Set before torch looks at CUDA; inherited by the rank server, the ranks and subprocesses.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
STRATEGY_NAMES = [n for n in STRATEGIES.names() if (ROOT / "conf" / "strategy" / f"{n}.yaml").exists()]
"""Every shipped strategy (registered, with its YAML): the tests parametrize over these, so a
new strategy is held against DDP, resumed and measured without editing a test list."""

# Small and fast on 2 cores; tests shrink further where they can.
TINY = [
    "trainer.steps=6",
    "trainer.warmup_steps=1",
    "trainer.batch_size=8",
    "trainer.log_interval=2",
    "trainer.progress_bar=false",
    "trainer.timeout_s=60",
    "logger=none",  # W&B has its own tests (test_wandb.py)
    "model.hidden=32",
    "model.depth=2",
]
TINY_GPT = [
    "model=gpt",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.seq_len=16",
    "model.vocab_size=64",
]


def compose_cfg(overrides: list[str], config_name: str = "config"):
    return compose(overrides, config_name)


def tiny(overrides: list[str]) -> list[str]:
    """TINY defaults; the MLP's model.* keys are dropped for other models (they have other fields)."""
    if "model=gpt" in overrides:
        base = [o for o in TINY if not o.startswith("model.")] + TINY_GPT
        overrides = [o for o in overrides if o != "model=gpt"]
    elif any(o.startswith("model=") and o != "model=mlp" for o in overrides):
        base = [o for o in TINY if not o.startswith("model.")]  # another model: its own shapes
    else:
        base = TINY
    return base + overrides


def launch_job(overrides: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    """Compose and launch in this process (ranks are real child processes)."""
    from sharded_exp.launch.parent import launch

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return launch(compose_cfg(tiny(overrides)), str(out))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class SharedRuns:
    """Jobs run once per test session and shared by every test that asks for the same
    overrides (and environment): one run serves parity, states, peak and digest checks."""

    def __init__(self, factory):
        self._factory = factory
        self._cache: dict = {}

    def __call__(self, *overrides: str, env: dict[str, str] | None = None) -> tuple[Path, dict]:
        key = (overrides, tuple(sorted((env or {}).items())))
        if key not in self._cache:
            out = self._factory.mktemp("shared")
            self._cache[key] = (out, launch_job(list(overrides), out, env=env))
        return self._cache[key]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory)


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 180, module: str = "sharded_exp"
):
    """``python -m MODULE ARGS`` (sharded_exp by default) in a subprocess, as a user types it."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


BLOCKER = """
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == {package!r} or name.startswith({package!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
"""


def without_package(tmp_path: Path, package: str) -> dict[str, str]:
    """Environment in which ``package`` cannot be imported by any process of a job (the parent,
    the forkserver, the ranks), as if uninstalled: a sitecustomize on PYTHONPATH refuses it."""
    site = tmp_path / f"without_{package}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(package=package))
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}


TINY_HF = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=2,
                                                     num_key_value_heads=2, max_position_embeddings=32)),
    "bert": ("BertForTokenClassification", "BertConfig", dict(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                             num_attention_heads=2, intermediate_size=64,
                                                             max_position_embeddings=32, num_labels=5,
                                                             hidden_dropout_prob=0.0,
                                                             attention_probs_dropout_prob=0.0)),
}  # fmt: skip
_saved: dict[str, str] = {}


def saved_tiny_hf(factory, kind: str) -> str:
    """A tiny Hugging Face model (``TINY_HF[kind]``, seeded random weights) written by
    ``save_pretrained`` into a directory of this test session, once: a user's weights."""
    if kind not in _saved:
        import torch
        import transformers

        model_class, config_class, sizes = TINY_HF[kind]
        torch.manual_seed(123)
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**sizes))
        directory = factory.mktemp(f"saved_{kind}")
        model.save_pretrained(directory)
        _saved[kind] = str(directory)
    return _saved[kind]


def read_result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


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
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


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
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or exitstatus not in (0, 1):
        return
    import jsonschema

    schema = json.loads((ROOT / "docs" / "result.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    checked, bad = 0, []
    for path in factory.getbasetemp().rglob("result.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a test's deliberately broken file
        if not isinstance(data, dict) or "schema_version" not in data:
            continue
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
