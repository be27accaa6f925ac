#!/usr/bin/env bash
# The GPU figures in the docs, cheapest and most asked-for stage first, so a short lease gets the most answers:
#   env          nvidia-smi, and the torch build and the GPUs it sees, with the seconds `import torch`
#                took; an import still running 30 s before the stage's limit prints where it waits
#   smoke_1gpu   the self-test's tiny job, 3 steps on one GPU
#   smoke_2gpu   the same on 2 GPUs through run_train.sh (torchrun, nccl) with NCCL_DEBUG=INFO: the first
#                distributed stage, so NCCL's set-up is on the record (skipped with one GPU)
#   1B_zero0, 1B_zero3   the 1B flavour for 20 steps in bf16 with ZeRO-0 (autocast over fp32 weights) and
#                ZeRO-3 (FSDP2 mixed precision): tokens/s, MFU, peak memory
#   1B_fp8_tensorwise, 1B_fp8_rowwise   the same under ZeRO-3 with FP8 matmuls (torchao; tensorwise
#                weights all-gathered in FP8): tokens/s, MFU (against the bf16 peak, as above), memory
#   cuda_tests   the tests that need a GPU: varlen attention, the ring's CUDA kernels (a ring of one rank),
#                a step that never waits for the GPU
#   moe          the MoE debug model in bf16, its experts as grouped GEMM: ep 2 on 2 GPUs, else ep 1
#   moe_fp8      the same under FP8 rowwise, its experts through torchao's grouped FP8 GEMM
#   ring_cp2     context parallelism by ring attention on 2 GPUs, bf16 (skipped with one GPU)
#   muon_zero3   the 1B flavour under Muon and ZeRO-3 (Newton-Schulz on FSDP2's shards): tokens/s
#   auto         layout = "auto" on the 1B flavour with 2 trials: the planner's pick against measurement
#   selftest     `torchpar selftest`: fp32 and bf16, every layout the GPUs hold, each against one GPU
# then each run's figures (tokens/s, MFU, memory) and a last line with each stage's result: ok or its
# exit code, and its seconds.
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

# The stages say `python`; an image that has only python3 (a virtual environment's, say) gets a shim
# that runs it by its own path, so the environment's packages come along.
if ! command -v python >/dev/null && command -v python3 >/dev/null; then
  mkdir -p "$OUT/bin"
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$OUT/bin/python"
  chmod +x "$OUT/bin/python"
  export PATH="$OUT/bin:$PATH"
fi
GPUS=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
TINY=(--config torchpar/assets/selftest.toml --training.steps 3)
# A real-sized job's common flags: no checkpoints or evaluation, figures every 5 steps.
RUN=(--checkpoint.enable false --validation.enable false --metrics.log_freq 5)
# (the 1B runs also probe the GPU and log the planner's step time beside the measured one)
ONE_B=(--config train_configs/debug_model.toml --model.flavor 1B --training.steps 20 --training.seq_len 2048
       --training.local_batch_size 4 --metrics.predict_step_time true "${RUN[@]}")
# (faulthandler's timer prints every thread's stack if the import alone nears the limit)
IMPORT="import faulthandler, time; faulthandler.dump_traceback_later($((SMOKE_S > 60 ? SMOKE_S - 30 : SMOKE_S / 2)), exit=True); t = time.time(); import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count(), f'(import torch: {time.time() - t:.1f} s)')"
stage env "$SMOKE_S" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader && python -c \"$IMPORT\""
stage smoke_1gpu "$SMOKE_S" python -m torchpar train "${TINY[@]}" --job.dump_folder "$OUT/smoke_1gpu"
if [ "$GPUS" -ge 2 ]; then
  stage smoke_2gpu "$SMOKE_S" env NGPU=2 CONFIG_FILE=torchpar/assets/selftest.toml NCCL_DEBUG=INFO \
    ./run_train.sh --training.steps 3 --job.dump_folder "$OUT/smoke_2gpu"
else
  SUMMARY+=("smoke_2gpu skipped ($GPUS GPU)")
fi
for zero in 0 3; do
  stage "1B_zero$zero" "$STAGE_S" python -m torchpar train "${ONE_B[@]}" --parallelism.zero_stage "$zero" \
    --job.dump_folder "$OUT/1B_zero$zero"
done
for recipe in tensorwise rowwise; do
  stage "1B_fp8_$recipe" "$STAGE_S" python -m torchpar train "${ONE_B[@]}" --parallelism.zero_stage 3 \
    --quantize.float8 "$recipe" --job.dump_folder "$OUT/1B_fp8_$recipe"
done
stage cuda_tests "$STAGE_S" python -m pytest -q -p no:cacheprovider tests/test_attention.py \
  tests/test_context.py::test_the_ring_drives_cudas_kernels \
  tests/test_guard.py::test_an_unlogged_step_never_waits_for_the_gpu \
  tests/test_float8.py::test_torchaos_grouped_fp8_gemm_is_the_loops_product
# latent against grouped-query attention; a sliding window against full at 4k and 16k tokens (varlen)
stage attention "$STAGE_S" python benchmarks/attention.py --repeats 3
# (run_train.sh's config is its CONFIG_FILE, train_configs/debug_model.toml by default)
# (the debug experts are smaller than torchao's size rule lets gain: converted all the same)
MOE_FP8=(--quantize.float8 rowwise --quantize.skip_small false)
MOE=(--model.name moe --training.steps 20 --training.seq_len 2048 --training.local_batch_size 8 "${RUN[@]}")
if [ "$GPUS" -ge 2 ]; then
  stage moe "$STAGE_S" env NGPU=2 ./run_train.sh "${MOE[@]}" --parallelism.expert_parallel_degree 2 \
    --job.dump_folder "$OUT/moe"
  stage moe_fp8 "$STAGE_S" env NGPU=2 ./run_train.sh "${MOE[@]}" "${MOE_FP8[@]}" \
    --parallelism.expert_parallel_degree 2 --job.dump_folder "$OUT/moe_fp8"
  stage ring_cp2 "$STAGE_S" env NGPU=2 ./run_train.sh --training.steps 20 --training.seq_len 4096 --training.local_batch_size 4 "${RUN[@]}" \
    --parallelism.context_parallel_degree 2 --parallelism.context_parallel_method ring \
    --job.dump_folder "$OUT/ring_cp2"
else
  stage moe "$STAGE_S" python -m torchpar train --config train_configs/debug_model.toml "${MOE[@]}" \
    --job.dump_folder "$OUT/moe"
  stage moe_fp8 "$STAGE_S" python -m torchpar train --config train_configs/debug_model.toml "${MOE[@]}" \
    "${MOE_FP8[@]}" --job.dump_folder "$OUT/moe_fp8"
  SUMMARY+=("ring_cp2 skipped ($GPUS GPU)")
fi
# (on 2 GPUs each matrix is orthogonalized by one owner, its rows brought by NCCL all-to-alls; on one
# there is nothing to share)
if [ "$GPUS" -ge 2 ]; then
  stage muon_zero3 "$STAGE_S" env NGPU=2 CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh \
    "${ONE_B[@]:2}" --optimizer.name muon --parallelism.zero_stage 3 --job.dump_folder "$OUT/muon_zero3"
else
  stage muon_zero3 "$STAGE_S" python -m torchpar train "${ONE_B[@]}" --optimizer.name muon \
    --parallelism.zero_stage 3 --job.dump_folder "$OUT/muon_zero3"
fi
stage auto "$STAGE_S" python -m torchpar train "${ONE_B[@]}" --parallelism.layout auto \
  --parallelism.auto_trials 2 --job.dump_folder "$OUT/auto"
mkdir -p "$OUT/tmp/selftest"
stage selftest "$STAGE_S" env TMPDIR="$OUT/tmp/selftest" python -m torchpar selftest --json "$OUT/selftest.json"
if [ "$RC" -eq 0 ]; then rm -rf "$OUT/tmp"; fi
python - "$OUT" <<'PY' || true
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*/metrics.jsonl")):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    if not steps:
        continue
    last = steps[-1]
    mfu = "n/a" if last.get("mfu") is None else f"{100 * last['mfu']:.1f}%"
    memory = "".join(f" {what} {last[key]:.1f} GiB" for what, key in
                     (("peak allocated", "mem_max_allocated_gib"), ("reserved", "mem_max_reserved_gib"))
                     if last.get(key) is not None)
    predicted = f" (planner: {last['predicted_step_s']:.3f} s)" if "predicted_step_s" in last else ""
    print(f"{path.parent.name}: step {last['step']} loss {last['loss']:.4f} tokens/s "
          f"{last['tokens_per_sec']:,.0f} step {last['step_s']:.3f} s{predicted} MFU {mfu}{memory}")
PY
LINE=$(printf ' | %s' "${SUMMARY[@]}")
echo "gpu_check: ${LINE:3}"
exit "$FAILED"
