#!/usr/bin/env bash
# On the GPU machine: its own Python and torch, the few packages it lacks from .whl/
# (scripts/device_wheels.sh, run beforehand where pip works), then every CUDA check in one
# run of at most about 8 minutes (benchmarks/accuracy/device_check.py). No network is needed.
#   scripts/device_check.sh            # extra arguments go to benchmarks.accuracy.device_check
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
python3 -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
PYTHONUNBUFFERED=1 timeout 540 python3 -m benchmarks.accuracy.device_check "$@"
status=$?
if [ -n "${OUT:-}" ]; then cp -r outputs/benchmarks/device_check.json "$OUT"/ 2>/dev/null || true; fi
exit $status
