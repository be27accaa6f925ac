"""LoRA's memory per rank against full fine-tuning.

At scale, from the planner: Llama 3 8B and 70B in bf16 on 8 H100s (ZeRO-3, and for 8B ZeRO-1 too),
a rank's parameters, gradients, optimizer state and activations, fully fine-tuned and with LoRA
adapters of rank ``--rank`` on every block's linear layer.

Here, measured: the debug Llama on 2 ranks (gloo) under ZeRO-3 and ZeRO-1 in fp32 and ZeRO-3 in
bf16, each rank's bytes as the trainer holds them (its ZeRO engine's accounting) beside the
planner's figures for the same job, and the peak of a training step (every storage followed)
beside the planner's device peak.

    python benchmarks/lora.py [--rank 16] [--seq 4096]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchpar.config import load_config  # noqa: E402
from torchpar.plan import layout_from_config, state_bytes  # noqa: E402
from torchpar.plan.estimate import rank_memory  # noqa: E402
from torchpar.selftest import BASE, spawn_ranks  # noqa: E402
from torchpar.train import Trainer  # noqa: E402
from torchpar.verify import step_peak_check  # noqa: E402

GIB, MIB = 2**30, 2**20
Z = "--parallelism.zero_stage"
AT_SCALE = {  # name: (flavor, world, overrides)
    "8B zero3 dp8": ("8B", 8, [Z, "3"]),
    "8B zero1 dp8": ("8B", 8, [Z, "1"]),
    "70B zero3 dp8": ("70B", 8, [Z, "3", "--training.activation_checkpoint", "full"]),
}
HERE = {"zero3 dp2": [Z, "3", "--training.local_batch_size", "4"],
        "zero1 dp2": [Z, "1", "--training.local_batch_size", "4"],
        # (bf16 compute: ZeRO-3 stores the frozen base in bf16 too)
        "zero3 dp2 bf16": [Z, "3", "--training.local_batch_size", "4", "--training.mixed_precision_param",
                           "bfloat16"]}


def lora_args(rank: int) -> list[str]:
    return ["--lora.rank", str(rank), "--lora.alpha", str(2 * rank)]


def at_scale(rank: int, seq: int) -> None:
    print(f"planner, bf16 on 8 x H100, seq {seq}, micro-batch 1: GiB per rank (the first)")
    print(f"{'layout':16} {'tuning':12} {'params':>8} {'grads':>8} {'optim':>8} {'activ.':>8} {'peak':>8}")
    for name, (flavor, world, overrides) in AT_SCALE.items():
        for tuning, extra in (("full", []), (f"LoRA r{rank}", lora_args(rank))):
            cfg = load_config(BASE, ["--model.flavor", flavor, "--parallelism.bucket_mb", "25",
                                     "--training.seq_len", str(seq), "--training.mixed_precision_param",
                                     "bfloat16", "--training.local_batch_size", "1", *overrides, *extra])
            lay, model, args = layout_from_config(cfg, world, "cuda")
            mem = rank_memory(model, args, lay, seq, 0)
            figures = [mem[k] / GIB for k in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes",
                                              "total_bytes")]
            print(f"{name:16} {tuning:12} " + " ".join(f"{f:8.2f}" for f in figures))


def _measure(rank, world, out, table):
    results = {}
    for name, overrides in table.items():
        cfg = load_config(BASE, [*overrides, "--job.dump_folder", f"{out}/{rank}"])
        peak = step_peak_check(cfg)
        lay, model, args = layout_from_config(cfg, world, "cpu")
        predicted = state_bytes(model, args, lay, lay.rank_coords(rank))
        trainer = Trainer(cfg)  # (a step, then what its engine holds: gradients and optimizer state exist)
        trainer.train_state.step = 1
        trainer.train_step(iter(trainer.dataloader))
        measured = trainer.model.state.state_bytes()
        trainer.close()
        results[name] = {"measured": measured, "predicted": predicted, **peak}
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, f"{out}/results.pt")


def here(rank: int) -> None:
    table = {f"{name} {tuning}": [*overrides, *extra] for name, overrides in HERE.items()
             for tuning, extra in (("full", []), (f"LoRA r{rank}", lora_args(rank)))}
    out = spawn_ranks(_measure, 2, table)
    try:
        gathered = torch.load(f"{out}/results.pt", weights_only=False)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print("\nmeasured here: the debug Llama on 2 ranks, MiB per rank (rank 0) — measured / planner")
    print(f"{'layout':24} {'params':>17} {'grads':>17} {'optim':>17} {'step peak':>17}")
    for name in table:
        r = gathered[0][name]
        cells = [f"{r['measured'][k] / MIB:7.3f} / {r['predicted'][k] / MIB:7.3f}"
                 for k in ("param_bytes", "grad_bytes", "optim_bytes")]
        cells.append(f"{r['measured_bytes'] / MIB:7.2f} / {r['predicted_bytes'] / MIB:7.2f}")
        print(f"{name:24} " + " ".join(f"{c:>17}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16, help="LoRA's rank (alpha = 2 x rank)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length of the planner's jobs")
    a = ap.parse_args()
    at_scale(a.rank, a.seq)
    here(a.rank)


if __name__ == "__main__":
    main()
