#!/usr/bin/env bash
# The GPU figures in the README: `torchpar selftest` on this machine's GPUs (fp32 and bf16, every
# layout they hold, each against one GPU), then the 1B flavour for 20 steps in bf16 on one GPU with
# ZeRO-0 (autocast over fp32 weights) and ZeRO-3 (FSDP2 mixed precision): tokens/s, MFU, peak memory.
#   benchmarks/gpu_check.sh [OUT_FOLDER]     (default outputs/gpu_check)
# Each stage has its own time limit (STAGE_S, default 240 s), so one stall cannot use up a short lease,
# and output is unbuffered, so what was printed before a stall is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}
STAGE_S=${STAGE_S:-240}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout "$STAGE_S" python -m torchpar selftest --json "$OUT/selftest.json" || echo "selftest: exit $?"
for zero in 0 3; do
  timeout "$STAGE_S" python -m torchpar train --config train_configs/debug_model.toml --model.flavor 1B \
    --training.steps 20 --training.seq_len 2048 --training.local_batch_size 4 \
    --parallelism.zero_stage "$zero" --checkpoint.enable false --validation.enable false \
    --metrics.log_freq 5 --job.dump_folder "$OUT/1B_zero$zero" || echo "1B zero $zero: exit $?"
done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for zero in (0, 3):
    path = Path(sys.argv[1]) / f"1B_zero{zero}" / "metrics.jsonl"
    if not path.exists():
        continue
    records = [json.loads(line) for line in path.read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    print(f"1B bf16 zero {zero}: step {last['step']} loss {last['loss']:.4f} tokens/s {last['tokens_per_sec']:,.0f} "
          f"MFU {100 * last['mfu']:.1f}% peak allocated {last['mem_max_allocated_gib']:.1f} GiB "
          f"reserved {last['mem_max_reserved_gib']:.1f} GiB")
PY
