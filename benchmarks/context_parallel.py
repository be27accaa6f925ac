"""Context parallelism at a fixed sequence length: each sequence split over 1, 2 and 4 ranks.

    python benchmarks/context_parallel.py [--seq 4096] [--steps 4] [--methods alltoall,ring]

For each degree and method: the most bytes alive at once during a training step on any rank
(activations, gradients and transients; followed storage by storage, as the planner's activation
figures are checked) beside the planner's activations + logits for that rank; and throughput as
tokens per second of the whole job (wall clock: what a user waits for) and per CPU-second summed
over the ranks (a rank waiting on an exchange is charged no CPU time, so on an oversubscribed
machine this is the fairer measure of the work). The debug Llama, one sequence per step, fp32,
one thread per rank, ZeRO-3 over the cp ranks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time

import torch

from torchpar.selftest import spawn_ranks

CONFIG = "torchpar/assets/selftest.toml"


def _worker(rank, world, out, seq, steps, method):
    from torchpar.config import load_config
    from torchpar.plan.activations import LiveStorages
    from torchpar.plan.estimate import rank_memory
    from torchpar.train import Trainer

    cfg = load_config(CONFIG, ["--model.max_seq_len", str(seq), "--training.seq_len", str(seq),
                               "--training.local_batch_size", "1", "--validation.enable", "false",
                               "--parallelism.context_parallel_degree", str(world),
                               "--parallelism.context_parallel_method", method,
                               "--parallelism.zero_stage", "3", "--job.dump_folder", f"{out}/run"])
    trainer = Trainer(cfg)
    try:
        batches = iter(trainer.dataloader)
        walls, cpus = [], []
        for step in range(1, steps + 2):
            trainer.train_state.step = step
            w0, c0 = time.perf_counter(), time.process_time()
            if step == 2:  # one step with every storage followed (slower: not timed)
                tracker = LiveStorages(peak=True)
                with tracker:
                    trainer.train_step(batches)
            else:
                trainer.train_step(batches)
            trainer.model.state.zero_grad()
            if step > 2:
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
        lay, model, args = trainer.layout, trainer.model_family, trainer.args
        mem = rank_memory(model, args, lay, seq, 0)
        result = {"peak": tracker.peak, "predicted": mem["activation_bytes"] + mem["logits_bytes"],
                  "wall": statistics.median(walls), "cpu": statistics.median(cpus)}
    finally:
        trainer.close()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4, help="timed steps after a warm-up and a tracked one")
    ap.add_argument("--methods", default="alltoall,ring")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"debug Llama, one {a.seq:,}-token sequence per step, fp32, 1 thread per rank; step times: "
          f"median of {a.steps}")
    print(f"{'cp':>3} {'method':<9} {'peak MiB/rank':>14} {'planner':>8} {'wall tok/s':>11} "
          f"{'tok/CPU-s':>10}")
    for method in a.methods.split(","):
        for cp in (1, 2, 4):
            if cp == 1 and method != a.methods.split(",")[0]:
                continue  # one process is the same for every method
            out = spawn_ranks(_worker, cp, a.seq, a.steps, method)
            ranks = []
            for r in range(cp):
                with open(f"{out}/rank{r}.json") as f:
                    ranks.append(json.load(f))
            shutil.rmtree(out, ignore_errors=True)
            peak = max(r["peak"] for r in ranks)
            predicted = max(r["predicted"] for r in ranks)
            wall = max(r["wall"] for r in ranks)  # the job waits for its slowest rank
            cpu = sum(r["cpu"] for r in ranks)
            print(f"{cp:>3} {method if cp > 1 else '-':<9} {peak / 2**20:>14.1f} {predicted / 2**20:>8.1f} "
                  f"{a.seq / wall:>11,.0f} {a.seq / cpu:>10,.0f}", flush=True)


if __name__ == "__main__":
    main()
