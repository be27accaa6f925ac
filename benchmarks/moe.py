"""Mixture of experts on this machine: tokens and active FLOPs per CPU-second of the `moe` debug
flavour without and with expert parallelism (ep 1, 2, 4), against a dense Llama of about the same
active parameters; the all-to-all bytes a step sends; grouped GEMM against the per-expert loop.

    python benchmarks/moe.py [--steps 8] [--batch 8] [--seq 64]

Each layout trains `--steps` steps of the self-test's job (one thread per rank); the figures are
medians over the steps after the first. CPU-seconds are every rank's process time summed, so
ranks that wait for each other count what their waiting costs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time

import torch

from torchpar.models import MODELS
from torchpar.models.moe import Experts
from torchpar.selftest import BASE, spawn_ranks

Z3 = ["--parallelism.zero_stage", "3"]
MOE = ["--model.name", "moe"]
# Llama of the moe debug flavour's attention, with SwiGLUs as wide as its two chosen experts (128)
DENSE = ["--model.n_layers", "4", "--model.ffn_dim_multiplier", "0.375"]
LAYOUTS = {  # name: (world, overrides)
    "dense": (1, DENSE),
    "moe ep1": (1, MOE),
    "moe dp2 ep1": (2, [*MOE, *Z3]),
    "moe dp2 ep2": (2, [*MOE, *Z3, "--parallelism.expert_parallel_degree", "2"]),
    "moe dp4 ep1": (4, [*MOE, *Z3]),
    "moe dp4 ep4": (4, [*MOE, *Z3, "--parallelism.expert_parallel_degree", "4"]),
}


def _worker(rank, world, out, overrides, steps):
    from torchpar.config import load_config
    from torchpar.parallel.ledger import CommLedger
    from torchpar.train import Trainer

    trainer = Trainer(load_config(BASE, [*overrides, "--job.dump_folder", f"{out}/run"]))
    batches, cpu, wall = iter(trainer.dataloader), [], []
    try:
        for step in range(1, steps + 1):
            trainer.train_state.step = step
            c0, t0 = time.process_time(), time.perf_counter()
            trainer.train_step(batches)
            trainer.model.state.zero_grad()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
        with CommLedger(trainer.layout.mesh, experts_view=trainer.layout.experts_view) as ledger:
            trainer.train_step(batches)
        a2a = sum(b for dim, kind, b, n in ledger.records if kind == "all_to_all" and dim == "ep")
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, cpu[1:])
        if rank == 0:
            torch.save({"cpu": [sum(c) for c in zip(*gathered)], "wall": wall[1:], "a2a": a2a,
                        "tokens": trainer.global_tokens, "args": trainer.args,
                        "family": trainer.cfg.model.name, "seq": trainer.cfg.training.seq_len},
                       f"{out}/result.pt")
    finally:
        trainer.close()


def grouped_vs_loop(repeats: int = 20) -> tuple[float, float]:
    """Milliseconds of one forward and backward of the debug flavour's 8 experts over 1024 rows
    (512 tokens x top 2, routed at random), grouped GEMM and the loop."""
    args = MODELS["moe"].args("debug")
    experts = Experts(args.dim, args.moe_hidden, args.experts)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randint(0, args.experts, (1024,), generator=gen).sort().values
    counts = torch.bincount(slots, minlength=args.experts)
    x = torch.randn(1024, args.dim, generator=gen, requires_grad=True)
    out = []
    for grouped in (True, False):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            experts(x, counts, grouped).square().mean().backward()
            times.append(time.perf_counter() - t0)
        out.append(1e3 * statistics.median(times[2:]))
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
    parser.add_argument("--seq", type=int, default=64)
    a = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'layout':<14}{'ranks':>6}{'active params':>15}{'tok/CPU-s':>11}{'GFLOP/CPU-s':>13}"
          f"{'step s':>8}{'a2a KiB/step':>14}")
    for name, (world, overrides) in LAYOUTS.items():
        job = [*overrides, "--training.local_batch_size", str(a.batch // world), "--training.seq_len",
               str(a.seq), "--training.steps", str(a.steps + 1)]
        out = spawn_ranks(_worker, world, job, a.steps)
        r = torch.load(f"{out}/result.pt", weights_only=False)
        shutil.rmtree(out, ignore_errors=True)
        model = MODELS[r["family"]]
        counts = model.param_counts(r["args"])
        active = counts.get("active_layers", counts["layers"])
        cpu = statistics.median(r["cpu"])
        per_cpu = r["tokens"] / cpu
        flops = per_cpu * model.flops_per_token(r["args"], r["seq"]) / 1e9
        print(f"{name:<14}{world:>6}{active / 1e6:>14.2f}M{per_cpu:>11,.0f}{flops:>13.2f}"
              f"{statistics.median(r['wall']):>8.3f}{r['a2a'] / 1024:>14.1f}")
    grouped, loop = grouped_vs_loop()
    print(f"experts forward+backward, 1024 rows: grouped GEMM {grouped:.2f} ms, per-expert loop "
          f"{loop:.2f} ms ({loop / grouped:.2f}x)")


if __name__ == "__main__":
    main()
