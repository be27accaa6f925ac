#!/usr/bin/env bash
# The GPU figures in the README, cheapest stage first, so a short lease gets the most answers:
#   env          nvidia-smi, and the torch build and the GPUs it sees
#   smoke_1gpu   the self-test's tiny job, 3 steps on one GPU
#   smoke_2gpu   the same on 2 GPUs through run_train.sh (torchrun, nccl) with NCCL_DEBUG=INFO: the first
#                distributed stage, so NCCL's set-up is on the record (skipped with one GPU)
#   selftest     `torchpar selftest`: fp32 and bf16, every layout the GPUs hold, each against one GPU
#   1B_zero0, 1B_zero3   the 1B flavour for 20 steps in bf16 on one GPU with ZeRO-0 (autocast over fp32
#                weights) and ZeRO-3 (FSDP2 mixed precision): tokens/s, MFU, peak memory
# and a last line with each stage's result: ok or its exit code, and its seconds.
#   benchmarks/gpu_check.sh [OUT_FOLDER]     (default outputs/gpu_check)
# Each stage has its own time limit (SMOKE_S, default 180 s, for env and the smoke stages; STAGE_S,
# default 240 s, for the others), so one stall cannot use up a short lease. At its limit a stage's
# processes get SIGABRT (timeout -s ABRT): PYTHONFAULTHANDLER=1, set here for every Python process
# (torchrun's and the self-test's ranks inherit it), makes each print every thread's Python stack as it
# dies, which says where it hung; what still runs 10 s later is killed (-k 10). Such a stage's exit code
# is 124 (137 if it had to be killed). The self-test's ranks write to log files in a temporary folder,
# kept for a failed self-test under OUT_FOLDER/tmp/selftest. Output is unbuffered and each stage's is
# also in OUT_FOLDER/<stage>.log, so what was printed before a stall is kept. Exits 1 if a stage failed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: TMPDIR below points into it
SMOKE_S=${SMOKE_S:-180}
STAGE_S=${STAGE_S:-240}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
ulimit -c 0  # SIGABRT would otherwise leave a core file of every GPU process
SUMMARY=()
FAILED=0
RC=0  # the last stage's exit code

# stage NAME LIMIT_S COMMAND...: run COMMAND under the limit, its output also in OUT/NAME.log.
stage() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit $limit s): $*"
  set +e
  timeout -k 10 -s ABRT "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  RC=${PIPESTATUS[0]}
  set -e
  local took=$((SECONDS - start))
  if [ "$RC" -eq 0 ]; then
    SUMMARY+=("$name ok ${took}s")
  else
    FAILED=1
    case $RC in 124 | 137) SUMMARY+=("$name exit $RC (limit) ${took}s") ;; *) SUMMARY+=("$name exit $RC ${took}s") ;; esac
  fi
}

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
TINY=(--config torchpar/assets/selftest.toml --training.steps 3)
stage env "$SMOKE_S" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader && python -c \"import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count())\""
stage smoke_1gpu "$SMOKE_S" python -m torchpar train "${TINY[@]}" --job.dump_folder "$OUT/smoke_1gpu"
if [ "$GPUS" -ge 2 ]; then
  stage smoke_2gpu "$SMOKE_S" env NGPU=2 CONFIG_FILE=torchpar/assets/selftest.toml NCCL_DEBUG=INFO \
    ./run_train.sh --training.steps 3 --job.dump_folder "$OUT/smoke_2gpu"
else
  SUMMARY+=("smoke_2gpu skipped ($GPUS GPU)")
fi
mkdir -p "$OUT/tmp/selftest"
stage selftest "$STAGE_S" env TMPDIR="$OUT/tmp/selftest" python -m torchpar selftest --json "$OUT/selftest.json"
if [ "$RC" -eq 0 ]; then rm -rf "$OUT/tmp"; fi
for zero in 0 3; do
  stage "1B_zero$zero" "$STAGE_S" python -m torchpar train --config train_configs/debug_model.toml \
    --model.flavor 1B --training.steps 20 --training.seq_len 2048 --training.local_batch_size 4 \
    --parallelism.zero_stage "$zero" --checkpoint.enable false --validation.enable false \
    --metrics.log_freq 5 --job.dump_folder "$OUT/1B_zero$zero"
done
python - "$OUT" <<'PY' || true
import json, sys
from pathlib import Path
for zero in (0, 3):
    path = Path(sys.argv[1]) / f"1B_zero{zero}" / "metrics.jsonl"
    if not path.exists():
        continue
    records = [json.loads(line) for line in path.read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    mfu = "n/a" if last["mfu"] is None else f"{100 * last['mfu']:.1f}%"
    print(f"1B bf16 zero {zero}: step {last['step']} loss {last['loss']:.4f} tokens/s {last['tokens_per_sec']:,.0f} "
          f"MFU {mfu} peak allocated {last['mem_max_allocated_gib']:.1f} GiB "
          f"reserved {last['mem_max_reserved_gib']:.1f} GiB")
PY
LINE=$(printf ' | %s' "${SUMMARY[@]}")
echo "gpu_check: ${LINE:3}"
exit "$FAILED"
