#!/usr/bin/env bash
# Set up .venv on a fresh machine: torch first (CPU build unless an NVIDIA GPU is present),
# then this package with its test tools. Safe to re-run: when nothing changed since the last
# set-up, it says so in seconds.
#   scripts/setup.sh && .venv/bin/python -m sharded_exp
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }

# Already set up from these very files, and it imports from here: nothing to do (seconds).
stamp=".venv/.setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) torch=$TORCH_VERSION $(pwd)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "
import os, sys, torch, sharded_exp
sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' or not sharded_exp.__file__.startswith(os.getcwd()))" 2>/dev/null; then
  echo "setup: .venv is up to date (scripts/setup.sh, pyproject.toml and torch $TORCH_VERSION unchanged)"
  exit 0
fi
rm -f "$stamp"

if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch==$TORCH_VERSION"                      # PyPI's CUDA build
  elif wheel_dir=$(mktemp -d) && trap 'rm -rf "$wheel_dir"' EXIT && pip download -q --no-deps --no-index -d "$wheel_dir" "torch==$TORCH_VERSION" 2>/dev/null; then
    pip install -q "$wheel_dir"/torch-*.whl                     # a CPU wheel on local disk (find-links)
  else
    # A bare `torch` from PyPI is a multi-GB CUDA build on Linux: take PyTorch's CPU index.
    pip install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip install -q -e ".[dev]"
.venv/bin/python -c "import torch, fairscale, hydra, torchmetrics, transformers, wandb_workspaces; print('torch', torch.__version__, '| cuda', torch.cuda.is_available())"
# This CPU's `this` profile (the step-time prediction's figures, cached per machine and torch):
# measured here, about 20 s a thread count, where it is not cached yet, at the threads a rank of
# a 2-rank job and of a 1-rank job gets, so that the first run does not wait for it in its
# pre-flight check. A profile that cannot be measured here is measured by that run instead.
.venv/bin/python -c "
import os
from sharded_exp.measure import machine
cores = os.cpu_count() or 1
for threads in sorted({max(1, cores // 2), cores}):
    machine.this_figures(threads)
print('this CPU profile: cached at', machine.cache_path())" 2>&1 | tail -1 || echo "setup: the this profile was not measured (the first run will)"
echo "$want" > "$stamp"
