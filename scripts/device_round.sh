#!/usr/bin/env bash
# On the GPU machine, one prepared run of about 6 minutes: what the planner and every run
# predict against what one GPU measures (issues 47 and 49), at world size 1.
#   1. every strategy x precision (bf16, 16, 32): peak allocated and reserved against the fake
#      step replayed through the allocator model, step time against the run's own prediction
#      (the GPU measured as the `this` profile) and the planner's on the sourced profile
#      (benchmarks/accuracy/gpu_check_sourced.json, written before the run);
#   2. the allocator model's sequences against torch.cuda.memory_stats(), exactly.
# Set-up: scripts/device_wheels.sh here first (the packages that machine lacks, into .whl/),
# then the device run carries .whl and runs this script. Outputs (the two JSON files, their
# logs, the measured profile) go to $OUT when it is set, else stay under outputs/benchmarks.
#   scripts/device_round.sh                  # on the GPU machine
#   scripts/device_round.sh --accelerator cpu --steps 4 --strategies ddp --precisions bf16   # dry run here
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1 && [ -z "${PYTHON:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
LOGS=${OUT:-outputs/benchmarks}
mkdir -p "$LOGS" outputs/benchmarks
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || true
echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-(unset)}"
start=$(date +%s)
timeout 330 "$PY" -m benchmarks.accuracy.gpu_check "$@" 2>&1 | tee "$LOGS/gpu_check.log" | grep -v "^output:"
gpu=${PIPESTATUS[0]}
echo "gpu_check: exit $gpu after $(( $(date +%s) - start )) s"
cp outputs/benchmarks/gpu_check.json "$LOGS"/ 2>/dev/null || true
cp "${XDG_CACHE_HOME:-$HOME/.cache}/sharded_exp/this_profile.json" "$LOGS"/ 2>/dev/null || true
if [ "${1:-}" != "--accelerator" ]; then
  timeout 100 "$PY" -m benchmarks.accuracy.allocator_check --no-steps 2>&1 | tee "$LOGS/allocator_check.log"
  alloc=${PIPESTATUS[0]}
  echo "allocator_check: exit $alloc"
  cp outputs/benchmarks/allocator_check.json "$LOGS"/ 2>/dev/null || true
fi
echo "device round: $(( $(date +%s) - start )) s"
exit $(( gpu != 0 ))
