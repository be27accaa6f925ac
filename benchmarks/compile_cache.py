"""A job with compiled blocks started twice on one inductor cache folder, as a restart after a
failure starts it: the second start should find every graph the first compiled. Two ranks under
``run_train.sh`` for each layout; prints each start's first step (which compiles, or loads what
was compiled) and rank 0's FX graph cache hits and misses.

torch 2.13 pickles a device mesh with its cached hash, a hash of strings that differs from one
process to the next, and inductor keys a graph by the pickled meshes of its DTensors: every
tensor-parallel graph missed the cache in a new process until torchpar left that hash out.

    python benchmarks/compile_cache.py [--steps 2] [--layouts tp2,dp2_tp1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Z3 = ["--parallelism.zero_stage", "3"]
LAYOUTS = {
    "tp2": ["--parallelism.tensor_parallel_degree", "2", *Z3],
    "dp2": ["--parallelism.data_parallel_shard_degree", "2", *Z3],
}


def start(cache: str, out: str, layout: list[str], steps: int) -> tuple[float, int, int]:
    """One start of the job: its first step's seconds, rank 0's FX graph cache hits and misses."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCH_LOGS="inductor", NGPU="2",
               OMP_NUM_THREADS="1")
    run = subprocess.run(["./run_train.sh", "--training.steps", str(steps), "--training.compile", "true",
                          "--job.dump_folder", out, *layout], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    if run.returncode:
        raise SystemExit(f"the job failed ({run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    log = run.stdout + run.stderr
    hits = len(re.findall(r"\[rank0\].*fx graph cache hit", log))
    misses = len(re.findall(r"\[rank0\].*fx graph cache miss", log))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    return first["step_s"], hits, misses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    print(f"{'layout':8} {'start':>6} {'first step s':>13} {'fx hits':>8} {'fx misses':>10}")
    for name in args.layouts.split(","):
        with tempfile.TemporaryDirectory() as folder:
            cache = os.path.join(folder, "inductor")
            for which in ("cold", "again"):
                step_s, hits, misses = start(cache, os.path.join(folder, which), LAYOUTS[name], args.steps)
                print(f"{name:8} {which:>6} {step_s:13.1f} {hits:8d} {misses:10d}", flush=True)


if __name__ == "__main__":
    main()
