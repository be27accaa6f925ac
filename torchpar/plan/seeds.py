"""The planner held against published worked examples (``torchpar plan --seeds``): data, tensor
and pipeline parallelism and ZeRO on GPT-3- and BERT-sized models, each figure computed by the
planner beside the figure the example states."""

from __future__ import annotations

from torchpar.models import DEFAULT_FAMILY, MODELS
from torchpar.parallel.layout import Layout, grad_accum_steps
from torchpar.plan.estimate import pipeline_bubble
from torchpar.plan.layout import PRESETS, deepspeed_bytes, state_bytes

FAMILY = MODELS[DEFAULT_FAMILY]  # its gpt3-175B flavour is the tutorials' GPT-3
GB, MB = 1e9, 1e6


def _bert_large_data_parallel() -> dict:
    """BERT-Large-sized data parallelism on 8 x A100-80GB."""
    n, gpus, a100 = 340e6, 8, PRESETS["A100-80GB"]
    grad = 2 * n
    ring = 2 * (gpus - 1) / gpus * grad  # bytes each GPU sends in a ring all-reduce
    tokens = 256 * 512 // gpus  # global batch 256 sequences of 512 tokens
    compute = 6 * n * tokens / (a100.peak_flops * 0.5)
    return {
        "example": "BERT-Large (340M) data parallel on 8 x A100-80GB",
        "seed": "fp16 params 680 MB, grads 680 MB, Adam states 2.7 GB, ~4 GB total; all-reduce 680 MB x 8 = "
        "5.44 GB, ~9 ms over NVLink 600 GB/s; compute ~200 ms",
        "exact": {"fp16_params_MB": 2 * n / MB, "fp16_grads_MB": grad / MB, "adam_moments_GB": 8 * n / GB,
                  "fp32_master_GB": 4 * n / GB, "total_mixed_precision_GB": 16 * n / GB,
                  "allreduce_sent_per_gpu_MB": ring / MB, "allreduce_ms": 1e3 * ring / a100.intra_bw,
                  "compute_ms_seq512_50pct": 1e3 * compute,
                  "comm_share": ring / a100.intra_bw / (compute + ring / a100.intra_bw)},
        "note": f"The ~4 GB leaves out the fp32 master copy ({4 * n / GB:.2f} GB): mixed-precision Adam "
                f"holds 16 bytes per parameter, {16 * n / GB:.2f} GB. A ring all-reduce sends 2(N-1)/N x "
                f"{grad / MB:.0f} MB = {ring / GB:.2f} GB per GPU, not {grad / MB:.0f} MB x 8; at "
                f"{a100.intra_bw / GB:.0f} GB/s per direction (NVLink's 600 GB/s counts both) that is "
                f"{1e3 * ring / a100.intra_bw:.2f} ms, {100 * ring / a100.intra_bw / compute:.1f}% of the "
                f"{1e3 * compute:.0f} ms of compute.",
    }


def _gpt3_memory() -> dict:
    """GPT-3 175B: weights and Adam."""
    args = FAMILY.args("gpt3-175B")
    n = FAMILY.num_params(args)
    return {
        "example": "GPT-3 175B memory",
        "seed": "fp16 weights ~350 GB; with Adam (2 extra fp32 copies) and gradients over 1.2 TB",
        "exact": {"params": n, "fp16_weights_GB": 2 * n / GB, "seed_components_TB": 12 * n / 1e12,
                  "mixed_precision_adam_TB": 16 * n / 1e12},
        "note": f"torchpar's gpt3-175B has {n / 1e9:.2f}B parameters (untied {args.vocab_size}-token "
                "embedding and head). The seed's own parts (fp16 weights + fp16 grads + two fp32 moments = "
                f"12 bytes/param) give {12 * n / 1e12:.2f} TB, and the fp32 master copy makes 16 bytes/param "
                f"= {16 * n / 1e12:.2f} TB: 'over 1.2 TB' is true but less than half of it.",
    }


def _gpt3_qkv_under_tp() -> dict:
    """TP = 8 shard of the QKV projection."""
    d = FAMILY.args("gpt3-175B").dim
    qkv = d * 3 * d
    return {
        "example": "GPT-3 175B QKV projection under TP = 8",
        "seed": "12288 x 36864 ~ 1.8 GB (fp16); each of 8 shards 12288 x 4608 ~ 226 MB",
        "exact": {"qkv_fp16_MB": 2 * qkv / MB, "qkv_fp32_MB": 4 * qkv / MB, "shard_cols": 3 * d // 8,
                  "shard_fp16_MB": 2 * qkv / 8 / MB},
        "note": f"1.8 GB and 226 MB are the fp32 sizes ({4 * qkv / MB:.0f} and {4 * qkv / 8 / MB:.0f} MB); "
                f"in fp16 the matrix is {2 * qkv / MB:.0f} MB and a shard {2 * qkv / 8 / MB:.0f} MB.",
    }


def _pipeline_bubble_pp4() -> dict:
    """PP = 4 with 16 microbatches."""
    bubble = {
        s: pipeline_bubble(Layout(pp=4, local_batch_size=16, schedule=s), 16) for s in ("GPipe", "1F1B")
    }
    return {
        "example": "PP = 4, 16 microbatches (global batch 2048 -> microbatches of 128)",
        "seed": "bubble (p-1)/(p-1+m) = 3/19 ~ 15.8%",
        "exact": {"bubble_GPipe": bubble["GPipe"], "bubble_1F1B": bubble["1F1B"], "formula": 3 / 19,
                  "microbatch_size": 2048 // 16},
        "note": "Measured on torch's own schedules (the same simulation as `torchpar schedule`): exactly "
                "3/19.",
    }


def _gpt3_on_64_gpus() -> dict:
    """64 GPUs as DP 2 x TP 8 x PP 4."""
    args = FAMILY.args("gpt3-175B")
    lay = Layout(pp=4, dp_shard=2, tp=8, zero_stage=0, local_batch_size=16, layers_per_stage=(24, 24, 24, 24))
    per_gpu = state_bytes(FAMILY, args, lay, {"pp": 1, "dp_shard": 0, "tp": 0})["param_bytes"] / 4
    first = state_bytes(FAMILY, args, lay, {"pp": 0, "dp_shard": 0, "tp": 0})["param_bytes"] / 4
    ds0, ds1 = deepspeed_bytes(per_gpu, 0, 2), deepspeed_bytes(per_gpu, 1, 2)
    return {
        "example": "175B on 64 GPUs as DP 2 x TP 8 x PP 4",
        "seed": "each GPU keeps 1/8 of the parameters (TP) of 1/4 of the layers (PP) and sees 1/2 of the "
        "data",
        "exact": {"params_per_gpu_middle_stage": per_gpu, "params_per_gpu_first_stage": first,
                  "mixed_precision_GB_no_zero": sum(ds0.values()) / GB,
                  "mixed_precision_GB_zero1": sum(ds1.values()) / GB},
        "note": f"A middle stage holds 24 layers / 8 = {per_gpu / 1e9:.2f}B parameters per GPU (the first "
                f"also 1/8 of the embedding). With Adam that is {sum(ds0.values()) / GB:.0f} GB without ZeRO "
                f"— more than an 80 GB GPU — and {sum(ds1.values()) / GB:.0f} GB with ZeRO-1 over the 2 "
                "data-parallel replicas, before activations.",
    }


def _deepspeed_batch_arithmetic() -> dict:
    """DeepSpeed's batch arithmetic."""
    accum = grad_accum_steps(4, 32, dp=4)
    return {
        "example": "DeepSpeed batch arithmetic",
        "seed": "micro-batch 4 x accumulation 2 x 4 GPUs = 32",
        "exact": {"accumulation": accum, "global_batch": 4 * accum * 4},
        "note": "torchpar: training.local_batch_size = 4, training.global_batch_size = 32 on 4 ranks gives "
                "2 accumulation steps (checked: other values are refused with the formula).",
    }


def seed_examples() -> list[dict]:
    """Each worked example of the tutorials, recomputed. Every item: what the tutorial says, the
    exact figures, and a note where it rounds or slips."""
    return [example() for example in (_bert_large_data_parallel, _gpt3_memory, _gpt3_qkv_under_tp,
                                      _pipeline_bubble_pp4, _gpt3_on_64_gpus, _deepspeed_batch_arithmetic)]
