"""Does the planner's step-time model rank layouts the way this machine does?

For each model shape and world size, every layout that fits (in the space below) is trained for a
few steps in one process group; its measured step time (median of the steps after the first, wall
clock of the whole job, the fastest of ``--passes`` passes) and peak bytes (every storage followed
through one step, the most over the ranks) are printed beside the planner's prediction for this
machine (probed: matmul and model rates, collectives' latency and bandwidth), with the rank
correlation and the median error; and the layout ``parallelism.layout = "auto"`` picks without
trials, and with trials of the planner's best k, against the fastest measured.

    python benchmarks/planner_truth.py                       # llama3 debug and a wide variant, 2 and 4 ranks
    python benchmarks/planner_truth.py --worlds 2 --steps 5 --recompute none full

The space: every degree, ZeRO stage, schedule and micro-batch the planner searches, with the
recomputation policies given (default: none only, the others multiply the runs by three for a
model that fits anyway); the layout auto picks is measured too when it lies outside the space.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchpar.config import load_config  # noqa: E402
from torchpar.models import adapter, model_args  # noqa: E402
from torchpar.plan.probe import cluster_of, probe  # noqa: E402
from torchpar.selftest import spawn_ranks  # noqa: E402
from torchpar.tools.auto_layout import plan_candidates, room_of, trial, trial_config  # noqa: E402
from torchpar.verify import step_peak_check  # noqa: E402

BASE = ROOT / "train_configs" / "debug_model.toml"
SHAPES = {  # name: model overrides
    "llama3 debug (dim 128, 8 layers)": [],
    "llama3 wide (dim 384, 4 layers)": ["--model.dim", "384", "--model.n_layers", "4", "--model.n_heads",
                                        "12", "--model.n_kv_heads", "4"],
}


def sample(ranked: list, most: int, top: int) -> list:
    """The planner's ``top`` best and, up to ``most`` in all, layouts spread evenly over the rest
    of its ranking (so the correlation is measured over the whole range)."""
    if len(ranked) <= most:
        return ranked
    rest = ranked[top:]
    step = len(rest) / (most - top)
    return ranked[:top] + [rest[int(i * step)] for i in range(most - top)]


def _worker(rank: int, world: int, out: str, shapes: dict, steps: int, policies: list[str], batch: int,
            trials: int, most: int, passes: int) -> None:
    results = {}
    for name, overrides in shapes.items():
        cfg = load_config(BASE, [*overrides, "--training.global_batch_size", str(batch), "--data.num_workers",
                                 "0"])
        figures = probe(torch.float32, adapter(cfg.model.name), model_args(cfg.model), cfg.training.seq_len,
                        fresh=True)  # (measured now, not read from the cache)
        cluster = cluster_of(figures, room_of(cfg, world).memory)
        cands, _ = plan_candidates(cfg, world, cluster, keep=10**6)
        auto = cands[0]
        measured = sample([c for c in cands if c.plan.layout["activation_checkpoint"] in policies], most,
                          max(trials, 3))
        if auto not in measured:
            measured.insert(0, auto)
        # Each layout timed in ``passes`` passes, every other one in reverse order, and its fastest
        # pass kept: this machine's speed drifts over minutes, which one pass would read as a
        # difference between the layouts timed early and late.
        times: dict[int, list[float]] = {}
        for p in range(passes):
            order = list(enumerate(measured))
            for i, c in order if p % 2 == 0 else order[::-1]:
                times.setdefault(i, []).append(trial(c.cfg, steps, Path(out) / f"{name[:6]}_{i}"))
        rows = []
        for i, c in enumerate(measured):
            folder = Path(out) / f"{name[:6]}_{i}"
            step_s = min(times[i])
            peak = step_peak_check(trial_config(c.cfg, 2, folder / "peak"))
            worst = torch.tensor([peak["measured_bytes"], peak["predicted_bytes"]], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            rows.append({"layout": c.name, "predicted_s": c.plan.step_s, "measured_s": step_s,
                         "predicted_bytes": worst[1].item(), "measured_bytes": worst[0].item(),
                         "planner_rank": cands.index(c) + 1})
            if rank == 0:
                print(f"[{world} ranks] {name}: {i + 1}/{len(measured)} {c.name}: predicted "
                      f"{c.plan.step_s:.3f} s, measured {step_s:.3f} s", file=sys.__stdout__, flush=True)
        results[name] = {"rows": rows, "figures": {k: v for k, v in figures.items() if k != "collectives"},
                         "trials": trials}
    if rank == 0:
        Path(out, "results.json").write_text(json.dumps(results))


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties get their mean rank)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


def summary(world: int, name: str, result: dict) -> list[str]:
    rows = result["rows"]
    f = result["figures"]
    lines = [f"\n## {name}, {world} ranks: {len(rows)} layouts; probe: matmul {f['matmul_flops'] / 1e9:.1f} "
             f"GFLOP/s per rank, model {f['model_flops'] / 1e9:.1f} GFLOP/s, memory "
             f"{f['memory_bw'] / 1e9:.1f} GB/s",
             f"  {'layout':<86} {'pred s':>7} {'meas s':>7} {'err':>6} {'pred MiB':>9} {'meas MiB':>9}"]
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        err = r["predicted_s"] / r["measured_s"] - 1
        lines.append(f"  {r['layout']:<86} {r['predicted_s']:>7.3f} {r['measured_s']:>7.3f} "
                     f"{100 * err:>+5.0f}% {r['predicted_bytes'] / 2**20:>9.1f} "
                     f"{r['measured_bytes'] / 2**20:>9.1f}")
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    med = statistics.median(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows)
    mem = statistics.median(abs(r["predicted_bytes"] / r["measured_bytes"] - 1) for r in rows)
    best = min(rows, key=lambda r: r["measured_s"])
    auto = min(rows, key=lambda r: r["planner_rank"])
    k = result["trials"]
    tried = sorted(rows, key=lambda r: r["planner_rank"])[:k]
    with_trials = min(tried, key=lambda r: r["measured_s"])
    lines += [f"  rank correlation (Spearman) of predicted and measured step time: {rho:.2f}",
              f"  median step-time error {100 * med:.0f}%; median peak-memory error {100 * mem:.1f}%",
              f"  auto without trials: {auto['layout']}: {auto['measured_s']:.3f} s, "
              f"{100 * (auto['measured_s'] / best['measured_s'] - 1):+.0f}% from the fastest measured "
              f"({best['layout']}: {best['measured_s']:.3f} s)",
              f"  auto with {k} trials: {with_trials['layout']}: "
              f"{100 * (with_trials['measured_s'] / best['measured_s'] - 1):+.0f}% from the fastest"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=4, help="steps per layout (the first is not timed)")
    ap.add_argument("--recompute", nargs="+", default=["none"], choices=["none", "selective", "full"])
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--trials", type=int, default=3, help="k of auto's trial mode, as reported")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--passes", type=int, default=2, help="times each layout is timed (every other pass in "
                    "reverse order; the fastest kept)")
    ap.add_argument("--most", type=int, default=24, help="layouts measured per shape and world at most: the "
                    "planner's best (the trials') and the rest sampled evenly over its ranking")
    a = ap.parse_args()
    if a.passes < 1 or a.steps < 2:
        ap.error("--passes must be at least 1 and --steps at least 2 (the first step is not timed)")
    print(f"planner truth: {a.steps} steps per layout in each of {a.passes} passes, global batch "
          f"{a.global_batch_size} x 128 tokens, recomputation {', '.join(a.recompute)}, at most {a.most} "
          "layouts per shape")
    for world in a.worlds:
        out = spawn_ranks(_worker, world, {s: SHAPES[s] for s in a.shapes}, a.steps, a.recompute,
                          a.global_batch_size, a.trials, a.most, a.passes)
        try:
            results = json.loads(Path(out, "results.json").read_text())
        finally:
            shutil.rmtree(out, ignore_errors=True)
        for name, result in results.items():
            print("\n".join(summary(world, name, result)), flush=True)


if __name__ == "__main__":
    main()
