"""The flat ZeRO 0-2 engine against PyTorch's own DDP, and ZeRO-3 (FSDP2), on 2 gloo ranks.

    python benchmarks/zero_engine.py [--steps 6] [--repeats 3] [--seq 512] [--batch 8] [--bucket-mb 4]

Same model, batch and bucket size for all (DDP's ``bucket_cap_mb`` = torchpar's
``parallelism.bucket_mb``); each variant in fresh processes, one thread per rank, interleaved
repeat by repeat; the first step untimed (its collectives counted by the communication ledger).
Prints tokens/s, tokens per CPU-second (user + system of both ranks), peak resident memory (the
larger rank's), MiB each rank sends per step, and the ratio of tokens per CPU-second to DDP's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from vs_plain_pytorch import SHAPE, worker

from torchpar.selftest import spawn_ranks

Z = "--parallelism.zero_stage"
VARIANTS = {
    "DDP (plain PyTorch)": (2, "ddp", None),
    **{f"torchpar ZeRO-{z}": (2, None, [Z, str(z)]) for z in (0, 1, 2)},
    "torchpar ZeRO-3 (FSDP2)": (2, None, [Z, "3"]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(a.repeats):
        for name, variant in VARIANTS.items():
            out = spawn_ranks(worker, 2, variant, a.steps, a.seq, a.batch, a.bucket_mb)
            runs[name].append(json.loads(Path(out, "result.json").read_text()))
            shutil.rmtree(out, ignore_errors=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ddp = med["DDP (plain PyTorch)"]["tokens_per_cpu_s"]
    print(f"llama {SHAPE}, batch {a.batch} x seq {a.seq} per rank, dp 2, fp32, buckets of {a.bucket_mb} MB, "
          f"1 thread per rank; median of {a.repeats} runs of {a.steps - 1} timed steps")
    print(f"{'variant':<26} {'tokens/s':>9} {'tokens/CPU-s':>13} {'peak RSS MiB':>13} {'sent MiB/step':>14}"
          "  vs DDP (tokens/CPU-s)")
    for name, m in med.items():
        ratio = m["tokens_per_cpu_s"] / ddp
        print(f"{name:<26} {m['tokens_per_s']:>9,.0f} {m['tokens_per_cpu_s']:>13,.0f} "
              f"{m['peak_rss_mib']:>13,.0f} {m['sent_mib_per_step']:>14.2f}  {ratio:.3f}x")


if __name__ == "__main__":
    main()
