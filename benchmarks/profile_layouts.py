"""Where each layout's CPU goes: torch profiler self times by kind of work, per rank-step, next to
the CPU time the ranks were charged, for one process and the layouts that split the work.

    python benchmarks/profile_layouts.py [--steps 3] [--masking]

Same model and batch as ``vs_plain_pytorch.py`` (Llama, dim 256, 6 layers, 16 heads; 8 x 512 tokens
per data-parallel rank, fp32, one thread per rank). Each layout runs in fresh processes: 2 untimed
steps, ``--steps`` steps charged by getrusage (no profiler), then ``--steps`` under the profiler.
Figures are milliseconds per 8 x 512 tokens summed over the ranks that share them, so a row that
costs more than one process's is overhead. The profiler's times are wall times of the ops on the
training thread: "waits" (collectives, their waits, FSDP2's gathers and reductions) are mostly
blocked time, not CPU; "outside ops" is the charged CPU less the ops' (gloo's threads, Python, the
kernel), which can go negative when waits are long.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections import Counter

import torch.distributed as dist
from vs_plain_pytorch import SHAPE, cpu_seconds, torchpar_step
from vs_torchtitan import PP

from torchpar.selftest import spawn_ranks

Z = "--parallelism.zero_stage"
LAYOUTS = {  # name: (ranks, ranks sharing one 8 x 512 batch, overrides)
    "1 process": (1, 1, [Z, "0"]),
    "dp 2, ZeRO-0": (2, 1, [Z, "0"]),
    "dp 2, ZeRO-3": (2, 1, [Z, "3"]),
    "tp 2 (SP, loss parallel)": (2, 2, ["--parallelism.tensor_parallel_degree", "2", Z, "0"]),
    "pp 2 (Interleaved1F1B)": (2, 2, [*PP, Z, "0"]),
}
KINDS = (  # (kind, what an op's name contains), first match wins
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("scaled_dot_product",)),
    ("loss", ("log_softmax", "nll_loss")),
    ("optimizer", ("_fused_adam", "_foreach")),
    ("waits", ("c10d", "wait_tensor", "FSDP::", "record_param_comms")),
    ("DTensor dispatch", ("PythonSubclass", "Redistribute", "FromTorchTensor", "ToTorchTensor",
                          "FromLocal", "ToLocal")),
    ("other ops", ("aten::",)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, keys in KINDS if any(k in name for k in keys)), "other")


def worker(rank, world, out, overrides, steps, masking):
    from torch.profiler import ProfilerActivity, profile

    trainer, step = torchpar_step(out, ["--data.document_masking", str(masking).lower(), *overrides], 512, 8)
    for i in (1, 2):
        step(i)
    dist.barrier()
    c0 = cpu_seconds()
    for i in range(3, 3 + steps):
        step(i)
    charged = cpu_seconds() - c0
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(3 + steps, 3 + 2 * steps):
            step(i)
        dist.barrier()
    kinds: Counter = Counter()
    for event in prof.key_averages():
        kinds[kind_of(event.key)] += event.self_cpu_time_total / 1e3  # us -> ms
    figures = {"cpu": charged * 1e3 / steps, **{k: v / steps for k, v in kinds.items()}}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(figures, f)
    trainer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--masking", action="store_true", help="document masking on (attention per document)")
    a = ap.parse_args()
    kinds = [k for k, _ in KINDS] + ["other"]
    rows = {}
    for name, (ranks, sharing, overrides) in LAYOUTS.items():
        out = spawn_ranks(worker, ranks, overrides, a.steps, a.masking)
        per_rank = [json.load(open(f"{out}/rank{r}.json")) for r in range(ranks)]
        shutil.rmtree(out, ignore_errors=True)
        # ms per 8 x 512 tokens: the ranks sharing one batch summed, the dp replicas averaged
        rows[name] = {k: sum(f.get(k, 0.0) for f in per_rank) * sharing / ranks for k in ["cpu", *kinds]}
        time.sleep(1)
    print(f"llama {SHAPE}, 8 x 512 tokens per batch, fp32, 1 thread per rank, masking={a.masking}; "
          f"ms per 8 x 512 tokens, summed over the ranks sharing them ({a.steps} steps each)")
    head = ["charged CPU", *kinds, "outside ops"]
    print(f"{'layout':<26}" + "".join(f"{h:>17}" for h in head))
    for name, r in rows.items():
        outside = r["cpu"] - sum(r[k] for k in kinds if k != "waits")
        print(f"{name:<26}" + "".join(f"{v:>17.0f}" for v in [r["cpu"], *(r[k] for k in kinds), outside]))


if __name__ == "__main__":
    main()
