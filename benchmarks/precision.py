"""Precision against convergence and speed: the same debug-model job (the default run's) trained in
fp32, bf16, and FP8 tensorwise and rowwise (torchao, through [quantize]), on one process; prints the
training loss each reaches (mean of the last 10 steps), the held-out loss at the end, tokens/s and
MFU (against the device's peak for the compute dtype: an FP8 run's against the peak of the dtype
beside its FP8 matmuls, so FP8 shows as a higher MFU).

    python benchmarks/precision.py [--steps 600] [--variants fp32 bf16 fp8-tensorwise fp8-rowwise]
                                   [--fp8-compute float32]

FP8 converts every linear layer of the blocks (quantize.skip_small = false: the debug model's layers
are all below torchao's size rule) and runs over ``--fp8-compute`` (the compute dtype under it:
float32 on a CPU, where bf16 matmuls are ~11x slower; bfloat16 on a GPU, as one would train). On a
CPU the figures to read are the losses: FP8 matmuls there are emulated, not fast.
"""

from __future__ import annotations

import argparse
import tempfile

from optimizers import debug_job  # (this folder: the scripts run from it)

VARIANTS = {
    "fp32": ["--training.mixed_precision_param", "float32"],
    "bf16": ["--training.mixed_precision_param", "bfloat16"],
    "fp8-tensorwise": ["--quantize.float8", "tensorwise", "--quantize.skip_small", "false"],
    "fp8-rowwise": ["--quantize.float8", "rowwise", "--quantize.skip_small", "false"],
}


def train(variant: str, steps: int, fp8_compute: str, folder: str) -> dict:
    """One run's figures, read back from its metrics.jsonl."""
    overrides = VARIANTS[variant]
    if variant.startswith("fp8"):
        overrides = [*overrides, "--training.mixed_precision_param", fp8_compute]
    records, cpu_s = debug_job(steps, overrides, folder)
    logged = [r for r in records if "loss" in r]
    last = logged[-10:]
    timed = logged[1:]
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "loss": sum(r["loss"] for r in last) / len(last),
        "val_loss": next(r["val_loss"] for r in reversed(records) if "val_loss" in r),
        "tokens_per_s": sum(r["tokens_per_sec"] for r in timed) / len(timed),
        "mfu": sum(mfu) / len(mfu) if mfu else None,
        "cpu_s": cpu_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--fp8-compute", default="float32", choices=["float32", "bfloat16"],
                    help="the compute dtype the FP8 runs use beside their FP8 matmuls")
    a = ap.parse_args()
    print(f"debug model, {a.steps} steps, one process; FP8 over {a.fp8_compute}")
    print(f"{'precision':<16} {'loss (last 10)':>15} {'held-out':>9} {'tok/s':>8} {'MFU':>7} {'CPU s':>7}")
    for variant in a.variants:
        with tempfile.TemporaryDirectory() as folder:
            r = train(variant, a.steps, a.fp8_compute, folder)
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"{variant:<16} {r['loss']:>15.4f} {r['val_loss']:>9.4f} {r['tokens_per_s']:>8,.0f} {mfu:>7} "
              f"{r['cpu_s']:>7.1f}")


if __name__ == "__main__":
    main()
