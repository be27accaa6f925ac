"""Muon against AdamW (and any other optimizer), each with its moments in fp32 or bf16: the same
debug-model job trained with each, on one process; prints the training loss each reaches (mean of
the last 10 steps), the held-out loss at the end, the bytes of optimizer state, the optimizer
phase's share of the step and the throughput.

    python benchmarks/optimizers.py [--steps 200] [--lr 3e-3] [--muon-lr 0.02] [--extra adafactor]
                                    [--state-dtypes float32 bfloat16]

CPU, fp32 (Muon's Newton-Schulz in fp32 too, its CPU default), one thread, ZeRO stage 0 (one
process: nothing to shard, and Adafactor needs whole matrices, which FSDP2's DTensors are not).
Each optimizer keeps torchpar's defaults otherwise (warmup 30 steps, cosine decay, weight decay
on matrices only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def debug_job(steps: int, overrides: list[str], folder: str) -> tuple[list[dict], float]:
    """The debug model trained ``steps`` steps on one process (one thread, ZeRO 0, evaluated at the
    end) with ``overrides``: its metrics.jsonl records and the CPU seconds it took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "-m", "torchpar", "train", "--config", "train_configs/debug_model.toml",
           "--training.steps", str(steps), *overrides, "--job.dump_folder", folder, "--metrics.log_freq", "1",
           "--validation.enable", "true", "--validation.freq", str(steps), "--validation.steps", "8",
           "--checkpoint.enable", "false", "--parallelism.zero_stage", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    records = [json.loads(line) for line in Path(folder, "metrics.jsonl").read_text().splitlines()]
    return records, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def train(name: str, steps: int, lr: float, muon_lr: float, folder: str,
          state_dtype: str = "float32") -> dict:
    """One run's figures, read back from its metrics.jsonl."""
    records, cpu_s = debug_job(steps, ["--optimizer.name", name, "--optimizer.lr", str(lr),
                                       "--optimizer.muon_lr", str(muon_lr), "--optimizer.state_dtype",
                                       state_dtype], folder)
    steps_ = [r for r in records if "loss" in r]
    last = steps_[-10:]
    timed = [r for r in steps_[1:] if "time_optimizer_s" in r]
    phases = ("time_forward_backward_s", "time_reduce_clip_s", "time_optimizer_s")
    step_s = sum(r[p] for r in timed for p in phases)
    return {
        "loss": sum(r["loss"] for r in last) / len(last),
        "val_loss": next(r["val_loss"] for r in reversed(records) if "val_loss" in r),
        "optimizer_share": sum(r["time_optimizer_s"] for r in timed) / step_s,
        "state_mib": steps_[0]["optim_bytes_per_rank"][0] / 2 ** 20,
        "tokens_per_s": sum(r["tokens_per_sec"] for r in steps_[1:]) / (len(steps_) - 1),
        "cpu_s": cpu_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr (and the lr of Muon's AdamW part)")
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--extra", nargs="*", default=[], help="more optimizer names to compare")
    ap.add_argument("--state-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="[optimizer] state_dtype of adamw and muon (the others keep float32)")
    a = ap.parse_args()
    print(f"debug model, {a.steps} steps, one process, CPU fp32; lr {a.lr:g}, muon_lr {a.muon_lr:g}")
    print(f"{'optimizer':<16} {'loss (last 10)':>15} {'held-out':>9} {'state MiB':>10} {'optimizer %':>12} "
          f"{'tok/s':>8} {'CPU s':>7}")
    runs = [(name, dtype) for name in ("adamw", "muon") for dtype in a.state_dtypes]
    for name, dtype in runs + [(name, "float32") for name in a.extra]:
        with tempfile.TemporaryDirectory() as folder:
            r = train(name, a.steps, a.lr, a.muon_lr, folder, dtype)
        label = name if dtype == "float32" else f"{name}, bf16 state"
        print(f"{label:<16} {r['loss']:>15.4f} {r['val_loss']:>9.4f} {r['state_mib']:>10.2f} "
              f"{100 * r['optimizer_share']:>11.1f}% {r['tokens_per_s']:>8,.0f} {r['cpu_s']:>7.1f}")


if __name__ == "__main__":
    main()
