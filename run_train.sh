#!/usr/bin/env bash
# Launch torchpar with torchrun.
#   NGPU         processes (default: the visible GPUs, else 2 on CPU)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   MAX_RESTARTS torchrun restarts after a failed rank (default 0)
# Further arguments are config overrides, e.g. --training.steps 50 --parallelism.tensor_parallel_degree 2
set -euo pipefail
cd "$(dirname "$0")"
# torchpar/device.py is the one place that knows the accelerator.
read -r DEFAULT_NPROC DEVICE_TYPE < <(python -m torchpar.device)
NGPU=${NGPU:-$DEFAULT_NPROC}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
MAX_RESTARTS=${MAX_RESTARTS:-0}
# Oversubscribed CPU ranks slow down badly with more than one thread each.
if [ "$DEVICE_TYPE" = cpu ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}
fi

# A restarted attempt often fails to reconnect its gloo mesh ("connectFullMesh ... Connection
# refused") when it reuses the first attempt's rendezvous store, so restarts get a fresh one. Without
# restarts the shared store is kept: it avoids rank 0 binding a second port, which another socket could
# take between torchrun and rank 0.
if [ "$MAX_RESTARTS" -gt 0 ]; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
# Check the config, data and layout once, so a mistake is one line, not one traceback per rank.
WORLD_SIZE="$NGPU" python -m torchpar.train --check --config "$CONFIG_FILE" "$@" || exit $?
exec torchrun --standalone --nproc-per-node "$NGPU" --max-restarts "$MAX_RESTARTS" \
  --local-ranks-filter "${LOG_RANK:-0}" \
  -m torchpar.train --config "$CONFIG_FILE" "$@"
