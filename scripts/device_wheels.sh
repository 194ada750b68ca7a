#!/usr/bin/env bash
# Here, before a device run: the wheels the GPU machine lacks (it has torch, transformers,
# torchmetrics, matplotlib, tqdm, tabulate; not Hydra, fairscale or pydantic; no package
# index), for its Python 3.12, into .whl/
# (git-ignored through .git/info/exclude; carried with `carry: [".whl"]`).
#   scripts/device_wheels.sh && <device run> scripts/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
# Pure-Python packages published as source only: built here into py3-none-any wheels.
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl antlr4-python3-runtime==4.9.3 fairscale==0.4.13
ls -la .whl
