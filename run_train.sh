#!/usr/bin/env bash
# Launch torchpar with torchrun, on one node or as one node of many.
#   NGPU          processes on this node (default: the visible GPUs, else 2 on CPU)
#   CONFIG_FILE   TOML config (default: train_configs/debug_model.toml)
#   NNODES        nodes in the job (default 1: a standalone single-node job)
#   NODE_RANK     this node's index, 0..NNODES-1 (default 0)
#   RDZV_ENDPOINT host:port of the c10d rendezvous on the first node (required when NNODES > 1)
#   RDZV_ID       the job's rendezvous id (default: SLURM_JOB_ID, else "torchpar")
#   MAX_RESTARTS  torchrun restarts after a failed rank (default 0)
#   LOG_RANK      local ranks whose output the console shows (default 0)
# Every rank's output also goes to <dump_folder>/logs/rank_<N>.log (job.rank_logs), torchrun's own log
# and failure report to <dump_folder>/logs/torchrun_node<NODE_RANK>.log. A failed job ends with the
# first failing rank's one line and its exit code (torchpar/commands/launch.py): 2 a mistake in the
# input or the launch (nodes that never joined within comm.timeout_s too), 3 a divergence stop, 4 the
# watchdog, 128 + N a stop on signal N (after a save) or a rank killed by it, 1 anything else.
# Further arguments are config overrides, e.g. --training.steps 50 --parallelism.tensor_parallel_degree 2
set -euo pipefail
cd "$(dirname "$0")"
fail() { echo "run_train.sh: error: $*" >&2; exit 2; }
# NGPU unset: torchpar/device.py, the one place that knows the accelerator, decides (in the launcher).
NGPU=${NGPU:-auto}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
MAX_RESTARTS=${MAX_RESTARTS:-0}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
[[ "$NGPU" =~ ^([1-9][0-9]*|auto)$ ]] || fail "NGPU=$NGPU: give the number of processes on this node, 1 or more"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || fail "NNODES=$NNODES: give the number of nodes, 1 or more"
[[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] || fail "NODE_RANK=$NODE_RANK: give 0..$((NNODES - 1))"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || fail "MAX_RESTARTS=$MAX_RESTARTS: give 0 or more"
[[ "${LOG_RANK:-0}" =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "LOG_RANK=$LOG_RANK: give local ranks, e.g. 0 or 0,1"
[[ "${SLURM_STEP_NUM_TASKS:-1}" =~ ^[1-9][0-9]*$ ]] ||
  fail "SLURM_STEP_NUM_TASKS=$SLURM_STEP_NUM_TASKS is not a number of tasks: start run_train.sh with srun, or unset it"
# srun starting one copy per task would start that many independent torchrun jobs.
if [ "${SLURM_STEP_NUM_TASKS:-1}" -gt "$NNODES" ]; then
  fail "started by srun as ${SLURM_STEP_NUM_TASKS} tasks for NNODES=$NNODES: start one per node (srun --ntasks-per-node=1) and set NNODES, NODE_RANK and RDZV_ENDPOINT, as scripts/slurm/train.sbatch does"
fi
if [ "$NNODES" -gt 1 ]; then
  [ -n "${RDZV_ENDPOINT:-}" ] || fail "NNODES=$NNODES needs RDZV_ENDPOINT=host:port, an address of the first node every node can reach"
  [[ "$RDZV_ENDPOINT" =~ ^.+:[1-9][0-9]*$ ]] || fail "RDZV_ENDPOINT=$RDZV_ENDPOINT: give host:port, e.g. node0:29500"
  # (torch would retry a host it cannot resolve, with pages of warnings, until its timeout)
  rdzv_host=${RDZV_ENDPOINT%:*} rdzv_port=${RDZV_ENDPOINT##*:}
  [ "${#rdzv_port}" -le 5 ] && [ "$rdzv_port" -le 65535 ] ||
    fail "RDZV_ENDPOINT=$RDZV_ENDPOINT: the port must be 1-65535"
  if [[ "$rdzv_host" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    IFS=. read -r -a parts <<< "$rdzv_host"
    for part in "${parts[@]}"; do
      [ "${#part}" -le 3 ] && [ "$((10#$part))" -le 255 ] ||
        fail "RDZV_ENDPOINT=$RDZV_ENDPOINT: $rdzv_host is not an IPv4 address (each part 0-255)"
    done
  fi
  # c10d rendezvous: the agents meet at the first node's store and agree on every rank.
  LAUNCH=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
          --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-torchpar}}")
else
  LAUNCH=(--standalone)
fi
# A restarted attempt often fails to reconnect its gloo mesh ("connectFullMesh ... Connection
# refused") when it reuses the first attempt's rendezvous store, so restarts get a fresh one. Without
# restarts the shared store is kept: it avoids rank 0 binding a second port, which another socket could
# take between torchrun and rank 0.
if [ "$MAX_RESTARTS" -gt 0 ]; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
# torchrun, with torchpar's reporting: the config, data and layout checked once for the whole world
# before any rank starts (a mistake is one line, not one traceback per rank), then one line and the
# failing rank's code, and waits that say so.
exec python -m torchpar.commands.launch "${LAUNCH[@]}" --nproc-per-node "$NGPU" --max-restarts "$MAX_RESTARTS" \
  --local-ranks-filter "${LOG_RANK:-0}" \
  -m torchpar train --config "$CONFIG_FILE" "$@"
