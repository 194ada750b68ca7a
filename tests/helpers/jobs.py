"""Real jobs for the integration tests: the real config tree composed with shrinking overrides,
launched in this process (the ranks are real child processes on gloo) or typed as a user types
them (``python -m ...`` in a subprocess). The one in-process launcher of the suite is
:func:`launch_job`."""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing.forkserver
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sharded_exp.compose import compose
from sharded_exp.job import result as job_result
from sharded_exp.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]

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
    """The job (``tiny`` shapes plus ``overrides``) composed and launched in this process, with
    ``env`` set for its duration; its result returned as result.json holds it."""
    from sharded_exp.launch.parent import launch

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        _start_rank_server()
        return launch(compose(tiny(overrides)), str(out)).as_written()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_rank_server() -> None:
    """Start this process's rank server, once, with every Hugging Face modeling module
    preloaded, as ``python -m sharded_exp model=hf_...`` preloads its model's
    (sharded_exp/launch/forkserver.py): the server outlives a job here, and the suite's
    many Hugging Face jobs then fork their ranks with transformers imported instead of
    importing it in each rank (1.3 CPU s a rank). A running server is left as it is."""
    from sharded_exp.launch import forkserver

    forkserver.context(sorted(set(forkserver.HF_MODELING.values())))
    multiprocessing.forkserver.ensure_running()


class SharedRuns:
    """Jobs run once per test session and shared by every test that asks for the same
    overrides (and environment): one run serves parity, states, peak and digest checks.

    The session's workers share them too (pytest-xdist gives each worker its own process and
    its own ``basetemp``, siblings in one directory): a job is run in that common directory
    under a file lock named by its key, by the first worker that asks; a worker asking later,
    or while it runs, waits on the lock and reads what it wrote. Without xdist the store is
    this session's ``basetemp``."""

    def __init__(self, factory):
        self._cache: dict = {}
        base = Path(factory.getbasetemp())
        self._store = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared_runs"
        self._store.mkdir(exist_ok=True)

    def __call__(self, *overrides: str, env: dict[str, str] | None = None) -> tuple[Path, dict]:
        key = (overrides, tuple(sorted((env or {}).items())))
        if key not in self._cache:
            self._cache[key] = self._run_once(key, list(overrides), env)
        return self._cache[key]

    def _run_once(self, key: tuple, overrides: list[str], env: dict[str, str] | None) -> tuple[Path, dict]:
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        out, done = self._store / name, self._store / f"{name}.result.json"
        with open(self._store / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the job raises
            if not done.exists():  # no worker has run it (or the one that tried failed: run it again)
                shutil.rmtree(out, ignore_errors=True)  # what a failed try left
                out.mkdir()
                result = launch_job(overrides, out, env=env)
                done.write_text(json.dumps(result))
            return out, json.loads(done.read_text())


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


def run_measurement(module: str, *args: str, cwd: Path, timeout: float = 300) -> dict:
    """``python -m MODULE ARGS`` (a benchmark or a regression gate) from an empty directory, the
    repository on the path: it must exit 0 and print its Markdown table; the JSON it wrote to
    ``outputs/benchmarks/<name>.json`` is returned."""
    proc = run_cli(list(args), cwd, env={"PYTHONPATH": str(ROOT)}, timeout=timeout, module=module)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "|---|" in proc.stdout  # the Markdown table
    return json.loads((cwd / "outputs" / "benchmarks" / f"{module.rsplit('.', 1)[-1]}.json").read_text())


def read_result(path: Path) -> dict:
    """``path``'s result.json, read by the product's reader (so it matches the schema), as the
    file holds it."""
    return job_result.read_result(str(path / "result.json")).as_written()


BLOCKER = """
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == {package!r} or name.startswith({package!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
"""


RECORDER = """
import os
import sys
import time

class _Recorded:
    def find_spec(self, name, path=None, target=None):
        if name in {packages!r}:
            with open({log!r}, "a") as f:
                f.write(f"{{name}} {{os.getpid()}} {{time.time()}}\\n")
        return None

sys.meta_path.insert(0, _Recorded())
"""


def without_package(tmp_path: Path, package: str) -> dict[str, str]:
    """Environment in which ``package`` cannot be imported by any process of a job (the parent,
    the forkserver, the ranks), as if uninstalled: a sitecustomize on PYTHONPATH refuses it."""
    site = tmp_path / f"without_{package}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(package=package))
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def recording_imports(tmp_path: Path, *packages: str) -> tuple[dict[str, str], Path]:
    """Environment in which every process of a job (the parent, the forkserver, the ranks)
    appends ``<package> <pid> <time.time()>`` to the returned file when it imports one of
    ``packages`` itself (a forked rank that inherited the module from the forkserver writes
    nothing): the file exists only if some process imported one."""
    site = tmp_path / "recording_imports"
    site.mkdir()
    log = site / "imports.txt"
    (site / "sitecustomize.py").write_text(RECORDER.format(packages=tuple(sorted(packages)), log=str(log)))
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}, log


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

TINY_CONFIGS = {
    # grouped-query attention (2 key/value heads for 4 query heads) where the architecture has it
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, max_position_embeddings=64)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, max_position_embeddings=64,
                                                           sliding_window=16)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, max_position_embeddings=64)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=2, num_attention_heads=4,
                                                            max_position_embeddings=64)),
}  # fmt: skip
"""Tiny causal-LM configs of the architectures ``model=hf_causal`` is held to: (model class,
config class, sizes), as a published config.json would give them."""


def write_tiny_config(directory, kind: str) -> str:
    """``TINY_CONFIGS[kind]``'s config.json, written by its config class's ``save_pretrained``
    into ``directory`` (a user's config of a published model, without its weights)."""
    import transformers

    _, config_class, sizes = TINY_CONFIGS[kind]
    getattr(transformers, config_class)(**sizes).save_pretrained(directory)
    return str(Path(directory) / "config.json")


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
