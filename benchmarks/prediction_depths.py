"""Multi-token prediction's cost and effect: the same debug-model job trained with 0, 1 and 2
prediction depths, on one process; prints the main head's training loss (mean of the last 10
steps) and held-out loss at the end, each depth's cross-entropy (loss/mtp1, ...: per token of the
step, as logged), the throughput and the CPU time.

    python benchmarks/prediction_depths.py [--steps 200] [--depths 0 1 2] [--weight 0.3]

CPU, fp32, one thread, ZeRO stage 0. The held-out loss is the main head's alone (evaluation runs no
depth), so it says whether the depths' extra gradient helps or hurts the model's own prediction at
equal steps; tokens/s counts the tokens the main head trains on (each depth costs a block and a head
pass more per token).
"""

from __future__ import annotations

import argparse
import tempfile

from optimizers import debug_job  # (this folder: the scripts run from it)


def train(depths: int, steps: int, weight: float, folder: str) -> dict:
    """One run's figures, read back from its metrics.jsonl."""
    records, cpu_s = debug_job(steps, ["--model.mtp_depth", str(depths), "--model.mtp_weight", str(weight)],
                               folder)
    logged = [r for r in records if "loss" in r]
    last = logged[-10:]
    return {
        "loss": sum(r["loss"] for r in last) / len(last),
        "val_loss": next(r["val_loss"] for r in reversed(records) if "val_loss" in r),
        "depths": [sum(r[f"loss/mtp{k}"] for r in last) / len(last) for k in range(1, depths + 1)],
        "tokens_per_s": sum(r["tokens_per_sec"] for r in logged[1:]) / (len(logged) - 1),
        "cpu_s": cpu_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--depths", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--weight", type=float, default=0.3, help="model.mtp_weight")
    a = ap.parse_args()
    print(f"debug model, {a.steps} steps, one process, CPU fp32; mtp_weight {a.weight:g}")
    print(f"{'depths':>6} {'loss (last 10)':>15} {'held-out':>9} {'each depth (last 10)':>22} {'tok/s':>8} "
          f"{'CPU s':>7}")
    for depths in a.depths:
        with tempfile.TemporaryDirectory() as folder:
            r = train(depths, a.steps, a.weight, folder)
        each = " ".join(f"{x:.4f}" for x in r["depths"]) or "-"
        print(f"{depths:>6} {r['loss']:>15.4f} {r['val_loss']:>9.4f} {each:>22} {r['tokens_per_s']:>8,.0f} "
              f"{r['cpu_s']:>7.1f}")


if __name__ == "__main__":
    main()
