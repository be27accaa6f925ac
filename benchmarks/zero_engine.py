"""The flat ZeRO 0-2 engine against PyTorch's own DDP, and ZeRO-3 (FSDP2), on 2 gloo ranks.

    python benchmarks/zero_engine.py [--steps 6] [--repeats 3] [--seq 512] [--batch 8] [--bucket-mb 4]

Same model, batch and bucket size for all (DDP's ``bucket_cap_mb`` = torchpar's
``parallelism.bucket_mb``); each variant in fresh processes, one thread per rank, interleaved
repeat by repeat; the first step untimed (its collectives counted by the communication ledger).
Prints tokens/s, tokens per CPU-second (user + system of both ranks), peak resident memory (the
larger rank's), MiB each rank sends per step, and the ratio of tokens per CPU-second to DDP's; then,
for torchpar's stages 0-2, what the overlap hides: the time per step the host waits for gradient
reductions after backward and for parameter gathers in the next forward, against the time the
same collectives take when run alone, blocking (measured after the run, same sizes and groups).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from vs_plain_pytorch import SHAPE, arguments, interleaved, medians, worker

Z = "--parallelism.zero_stage"
VARIANTS = {
    "DDP (plain PyTorch)": (2, "ddp", None),
    **{f"torchpar ZeRO-{z}": (2, None, [Z, str(z)]) for z in (0, 1, 2)},
    "torchpar ZeRO-3 (FSDP2)": (2, None, [Z, "3"]),
}


def timed_worker(rank, world, out, variant, steps, seq, batch, bucket_mb):
    """:func:`worker`, with the flat engine's waits timed (steps 2 on) and, after it, the same
    collectives run blocking for comparison."""
    from torchpar.parallel.flat import FlatZero

    waited = {"reduce": 0.0, "gather": 0.0}
    engines = []

    def timing(method, key):
        def timed(self, *args):
            if self not in engines:
                engines.append(self)
            t0 = time.perf_counter()
            method(self, *args)
            waited[key] += time.perf_counter() - t0
        return timed

    reduce, wait = FlatZero.reduce_gradients, FlatZero.wait_params
    FlatZero.reduce_gradients, FlatZero.wait_params = timing(reduce, "reduce"), timing(wait, "gather")
    worker(rank, world, out, variant, steps, seq, batch, bucket_mb)
    if not engines or engines[0].layout.dp == 1:
        return
    e = engines[0]
    grads = torch.zeros(e.bounds[-1], dtype=e.grad_dtype)
    dist.barrier()
    t0 = time.perf_counter()
    if e.stage == 2:
        shard = grads[: grads.numel() // e.shards].clone()
        dist.reduce_scatter_tensor(shard, grads, group=e._group("dp_shard"))
    else:
        dist.all_reduce(grads, group=e._group("dp"))
    alone = {"reduce": time.perf_counter() - t0, "gather": 0.0}
    if e.shards > 1:
        t0 = time.perf_counter()
        gathered, piece = e.flat.clone(), e.masters[0].new_zeros(e.bounds[-1] // e.shards)
        dist.all_gather_into_tensor(gathered, piece, group=e._group("dp_shard"))
        alone["gather"] = time.perf_counter() - t0
    dist.barrier()  # (gloo's threads are done with the tensors above before they are freed)
    # (waits are averaged over every step, the untimed first one included)
    if rank == 0:
        Path(out, "waits.json").write_text(json.dumps({
            "waited_ms": {k: 1e3 * v / steps for k, v in waited.items()},
            "alone_ms": {k: 1e3 * v for k, v in alone.items()}}))


def main() -> None:
    ap = arguments(repeats=3)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    a = ap.parse_args()
    runs = interleaved(VARIANTS, a.repeats, timed_worker, a.steps, a.seq, a.batch, a.bucket_mb)
    med = {name: medians(files["result.json"]) for name, files in runs.items()}
    waits = {name: files["waits.json"] for name, files in runs.items() if "waits.json" in files}
    ddp = med["DDP (plain PyTorch)"]["tokens_per_cpu_s"]
    print(f"llama {SHAPE}, batch {a.batch} x seq {a.seq} per rank, dp 2, fp32, buckets of {a.bucket_mb} MB, "
          f"1 thread per rank; median of {a.repeats} runs of {a.steps - 1} timed steps")
    print(f"{'variant':<26} {'tokens/s':>9} {'tokens/CPU-s':>13} {'peak RSS MiB':>13} {'sent MiB/step':>14}"
          "  vs DDP (tokens/CPU-s)")
    for name, m in med.items():
        ratio = m["tokens_per_cpu_s"] / ddp
        print(f"{name:<26} {m['tokens_per_s']:>9,.0f} {m['tokens_per_cpu_s']:>13,.0f} "
              f"{m['peak_rss_mib']:>13,.0f} {m['sent_mib_per_step']:>14.2f}  {ratio:.3f}x")

    print("\nwhat the overlap hides (ms per step on the host, median): waited for / the same "
          "collectives alone")
    for name, ws in waits.items():
        parts = []
        for key in ("reduce", "gather"):
            waited = statistics.median(w["waited_ms"][key] for w in ws)
            alone = statistics.median(w["alone_ms"][key] for w in ws)
            if alone:
                parts.append(f"{key} {waited:.1f} / {alone:.1f}")
        print(f"{name:<26} " + "; ".join(parts))


if __name__ == "__main__":
    main()
