#!/usr/bin/env bash
# On the GPU machine, one prepared run of at most about 7 minutes: what the planner and every
# run predict against what one GPU measures (issues 47 and 49), at world size 1.
#   small: every strategy x precision (bf16, 16, 32), a GPT of ~100M parameters (a step of
#          tens of ms: the host's cost per op shows): peak allocated and reserved against the
#          fake step replayed through the allocator model, step time against the run's own
#          prediction (the GPU measured as the `this` profile) and the planner's on the
#          sourced h200 profile (benchmarks/accuracy/gpu_check_sourced.json, written before);
#   big:   every strategy in bf16, a GPT of ~400M parameters and 8k tokens a step (the
#          kernels' time dominates), the same comparisons;
#   alloc: the allocator model's sequences against torch.cuda.memory_stats(), exactly;
#   offload: fsdp and fsdp_grad_op in bf16 with CPU offload, the small model: the shards' copies
#          and the optimizer's step on the host against the run's prediction (the GPU's host
#          measured with it: a 1 GiB copy and in-place update, a pinned buffer's copies each
#          way), and the pinned host memory torch holds (torch.cuda.host_memory_stats) against the
#          predicted power-of-two blocks (sharded_exp/predict/host_memory.py); GPU only (a CPU
#          run refuses cpu_offload);
#   snapshot: fsdp in bf16 on the small model, 6 steps, with the caching allocator's history
#          recorded and dumped (trainer.memory_snapshot=always; memory_snapshot_rank0.pickle,
#          https://pytorch.org/memory_viz): what is live at the peak the fake step reads 4-7% short;
#   floor: a tiny kernel's time on the device, launched from a CUDA graph, eagerly and
#          synchronised each (benchmarks/accuracy/kernel_floor.py): a cost per kernel the time
#          model does not count, one candidate for the big model's short predictions;
#   plan:  (not in the default) the planner's fake CUDA step of the small model's ddp and fsdp
#          in bf16 on this machine, with its GPU visible and hidden (CUDA_VISIBLE_DEVICES=''):
#          whether a fake step depends on a GPU being present.
# PARTS chooses (default: small big offload snapshot alloc floor); SMALL_PRECISIONS the small model's precisions.
# Set-up: scripts/device_wheels.sh here first (the packages that machine lacks, into .whl/),
# then the device run carries .whl and runs this script. Outputs (JSON files, logs, the
# measured profile) go to $OUT when it is set, else stay under outputs/benchmarks.
#   scripts/device_round.sh                         # on the GPU machine
#   PARTS="small big" SMALL_PRECISIONS="bf16 32" scripts/device_round.sh
#   PYTHON=.venv/bin/python scripts/device_round.sh --accelerator cpu --steps 4 --strategies ddp   # dry run here
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PARTS=${PARTS:-small big offload snapshot alloc floor}
if ls .whl/*.whl >/dev/null 2>&1 && [ -z "${PYTHON:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
LOGS=${OUT:-outputs/benchmarks}
mkdir -p "$LOGS" outputs/benchmarks
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || true
echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-(unset)}; parts: $PARTS"
start=$(date +%s)
status=0
check() {  # NAME SECONDS ARGS...: one gpu_check run, its log and JSON kept
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" "$PY" -m benchmarks.accuracy.gpu_check --name "$name" "$@" 2>&1 | tee "$LOGS/$name.log" \
    | grep -E "^\||done in|FAILED|^NVIDIA|^cpu;|wrote|pinned host"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc after $(( $(date +%s) - start )) s"
  cp "outputs/benchmarks/$name.json" "$LOGS"/ 2>/dev/null || true
  [ "$rc" = 0 ] || status=1
}
case " $PARTS " in *" small "*)
  # shellcheck disable=SC2086
  check gpu_check 240 --precisions ${SMALL_PRECISIONS:-bf16 16 32} "$@" ;;
esac
case " $PARTS " in *" big "*)
  check gpu_check_big 150 --model model=gpt model.d_model=2048 model.n_layers=8 model.n_heads=16 \
    model.seq_len=1024 --precisions bf16 "$@" ;;
esac
case " $PARTS " in *" offload "*)
  if [[ " $* " == *" cpu "* ]]; then
    echo "offload: skipped (a dry run on the CPU: a CPU run refuses strategy.cpu_offload)"
  else
    check gpu_check_offload 100 --model model=gpt model.d_model=1024 model.n_layers=8 model.n_heads=16 \
      model.seq_len=512 strategy.cpu_offload=true --strategies fsdp fsdp_grad_op --precisions bf16 "$@"
  fi ;;
esac
case " $PARTS " in *" snapshot "*)
  # The allocator's own record of FSDP2's mixed-precision step, whose peak the fake step reads
  # 4-7% short (docs/figures.md, "The round's peaks predicted again on its torch"): which
  # blocks are live at the peak, to set beside the fake step's. Recording costs step time: a
  # short run of its own, its timings not compared.
  check gpu_check_snapshot 90 --model model=gpt model.d_model=1024 model.n_layers=8 model.n_heads=16 \
    model.seq_len=512 trainer.memory_snapshot=always --strategies fsdp --precisions bf16 --steps 6 "$@"
  cp outputs/benchmarks/gpu_check_snapshot/fsdp_bf16/memory_snapshot_rank0.pickle "$LOGS"/ 2>/dev/null || true ;;
esac
cp "${XDG_CACHE_HOME:-$HOME/.cache}/sharded_exp/this_profile.json" "$LOGS"/ 2>/dev/null || true
case " $PARTS " in *" alloc "*)
  timeout 100 "$PY" -m benchmarks.accuracy.allocator_check --no-steps 2>&1 | tee "$LOGS/allocator_check.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  cp outputs/benchmarks/allocator_check.json "$LOGS"/ 2>/dev/null || true ;;
esac
case " $PARTS " in *" floor "*)
  timeout 60 "$PY" -m benchmarks.accuracy.kernel_floor 2>&1 | tee "$LOGS/kernel_floor.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || [ "$rc" = 2 ] || status=1  # 2: no CUDA here (a dry run), nothing measured
  cp outputs/benchmarks/kernel_floor.json "$LOGS"/ 2>/dev/null || true ;;
esac
case " $PARTS " in *" plan "*)
  for visible in yes no; do
    if [ $visible = no ]; then export CUDA_VISIBLE_DEVICES=''; fi
    echo "planner, GPU visible: $visible"
    timeout 120 "$PY" -m sharded_exp.plan model=gpt model.d_model=1024 model.n_layers=8 model.n_heads=16 \
      model.seq_len=512 precision=bf16 trainer.batch_size=8 plan.device=cuda 'plan.world_sizes=[1]' \
      'plan.strategies=[ddp,fsdp]' plan.alloc_conf= plan.format=csv 2>&1 | grep -v "^plan:" | tee -a "$LOGS/plan.log"
  done
  unset CUDA_VISIBLE_DEVICES ;;
esac
echo "device round: $(( $(date +%s) - start )) s"
exit $status
