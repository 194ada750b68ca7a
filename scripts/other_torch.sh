#!/usr/bin/env bash
# The unit tier on a torch other than the pinned one (scripts/setup.sh's 2.13): by default
# 2.11.0, the oldest release this project is tested on (pyproject.toml's floor) and the one
# the last GPU round ran. The fake step reaches into torch's private APIs (MemTracker,
# DTensor's sharding propagation, FSDP2's collectives, the FLOP formulas), which move between
# releases; on 2.11 four of them had broken every CPU prediction, every grouped-query plan
# and FSDP2's mixed-precision peaks until 2026-12-06 (docs/development/testing.md).
# PyPI's Linux build of torch is CUDA's (about 3 GB to download with its NVIDIA libraries,
# 5.7 GB installed); it imports and runs on a machine without a GPU. Its own environment:
# .venv-torch<version> (git ignores it; the tests that copy the tree leave it out).
#   scripts/other_torch.sh                         # torch 2.11.0, tests/unit (about 4 minutes fresh, 1 after)
#   TORCH_VERSION=2.12.0 scripts/other_torch.sh tests/unit/predict -x
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
PYTHON="${PYTHON:-python3}"
venv=".venv-torch$TORCH_VERSION"
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
# pip, without its warning for each of this machine's index directories it does not find
pip() { "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; }; }
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  pip install -q "torch==$TORCH_VERSION"
fi
pip install -q -e ".[dev]"
# the torch tested is the one asked for (a dependency that forced an upgrade would test another)
"$venv/bin/python" -c "
import sys, torch
print('other torch:', torch.__version__)
sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' and f'wanted torch $TORCH_VERSION, got {torch.__version__}')"
[ $# -gt 0 ] || set -- tests/unit
exec "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider "$@"
