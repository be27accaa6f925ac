"""Every layout of a model on a cluster, ranked; the explanation; ``torchpar plan``."""

from __future__ import annotations

import argparse
import json
import sys

from torchpar.config import ConfigError, did_you_mean, load_config
from torchpar.models import FLAVORS, model_args, num_params
from torchpar.plan.estimate import Plan, plan
from torchpar.plan.layout import PRESETS, Cluster, Layout, layout_from_config


# ------------------------------------------------------------------ search and the command


# Pipeline schedules the search tries: (name, stages per rank).
SEARCHED_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(args, cluster: Cluster, global_batch: int, seq: int, param_dtype_bytes: int = 2,
           efficiency: float = 0.5) -> list[Plan]:
    """Every layout that divides the world and the model, ranked by estimated tokens/s."""
    from torchpar.parallel.pipeline import balanced_split, schedule_problem

    plans = []
    world = cluster.world
    for tp in _divisors(cluster.gpus_per_node):
        if args.n_heads % tp or args.n_kv_heads % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > args.n_layers or (pp > 1 and args.tie_embeddings):
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            per_dp = global_batch // dp
            for zero, offload in ((0, False), (1, False), (2, False), (3, False), (3, True)):
                if zero in (1, 2, 3) and dp == 1 and not offload:
                    continue  # nothing to shard: the same as zero 0
                for ac in ("none", "full"):
                    for mbs in (1, 2, 4):
                        if per_dp % mbs:
                            continue
                        if pp == 1:
                            lay = Layout(1, 1, dp, tp, zero, mbs, per_dp // mbs, mbs, "1F1B", 1, ac, tp > 1, tp > 1,
                                         param_dtype_bytes, (), offload)
                            plans.append(plan(args, lay, cluster, seq, efficiency))
                            continue
                        n_micro = per_dp // mbs
                        for schedule, v in SEARCHED_SCHEDULES:
                            # Fewer microbatches than stages is mostly bubble: not searched.
                            if n_micro < pp or schedule_problem(schedule, pp, v, args.n_layers, n_micro):
                                continue
                            lay = Layout(pp, 1, dp, tp, zero, per_dp, 1, mbs, schedule, v, ac, tp > 1, tp > 1,
                                         param_dtype_bytes, tuple(balanced_split(args, pp * v)), offload)
                            plans.append(plan(args, lay, cluster, seq, efficiency))
    return sorted(plans, key=lambda p: (not p.fits, -p.tokens_per_sec))


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def describe_layout(lay: dict) -> str:
    micro = lay["microbatch_size"] if lay["pp"] > 1 else lay["local_batch_size"]
    return (f"pp {lay['pp']} x dp {lay['dp_replicate'] * lay['dp_shard']} x tp {lay['tp']}, zero {lay['zero_stage']}"
            + (" +offload" if lay["cpu_offload"] else "") + f", recompute {lay['activation_checkpoint']}, micro-batch {micro}"
            + (f", {lay['schedule']}" if lay["pp"] > 1 else f", accumulation {lay['accum']}"))


def explain(args, plans: list[Plan], cluster: Cluster) -> str:
    """The seeds' order of reasoning over the searched layouts: does DP + ZeRO fit? if not, TP
    inside a node; then PP across nodes; offload last — and what each choice costs."""
    n = num_params(args)
    world = plans[0].layout["pp"] * plans[0].layout["dp_replicate"] * plans[0].layout["dp_shard"] * plans[0].layout["tp"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    lines = [f"model: {size} parameters x 16 bytes (weights, gradients, Adam) = {_gb(16 * n)}; "
             f"{world} devices of {_gb(cluster.memory)} ({_gb(0.9 * cluster.memory)} usable)."]

    def smallest(pred):
        cands = [p for p in plans if pred(p.layout)]
        return min(cands, key=lambda p: p.memory["total_bytes"]) if cands else None

    steps = [("1. data parallel + ZeRO alone", lambda lay: lay["tp"] == 1 and lay["pp"] == 1 and not lay["cpu_offload"]),
             ("2. + tensor parallel inside a node", lambda lay: lay["tp"] > 1 and lay["pp"] == 1 and not lay["cpu_offload"]),
             ("3. + pipeline parallel", lambda lay: lay["pp"] > 1 and not lay["cpu_offload"]),
             ("4. + CPU offload of the ZeRO-3 state", lambda lay: lay["cpu_offload"])]
    for title, pred in steps:
        p = smallest(pred)
        if p is None:
            continue
        verdict = "fits" if p.fits else "does not fit"
        lines.append(f"{title}: smallest is {describe_layout(p.layout)} at {_gb(p.memory['total_bytes'])} per device "
                     f"-> {verdict}")
        if p.fits:
            fastest = next(q for q in plans if q.fits and pred(q.layout))
            exposed = fastest.step_s - fastest.compute_s / (1 - fastest.bubble)
            lines.append(f"   the fastest of these: {describe_layout(fastest.layout)}: step {fastest.step_s:.2f} s = compute "
                         f"{fastest.compute_s:.2f} s (with any recomputation) + bubble + exposed communication "
                         f"{exposed:.2f} s; {fastest.tokens_per_sec:,.0f} tokens/s")
            break
    fitting = [p for p in plans if p.fits]
    if not fitting:
        lines.append("nothing fits: more devices, a shorter sequence or a smaller micro-batch.")
        return "\n".join(lines)
    best = fitting[0]
    lines.append(f"fastest that fits: {describe_layout(best.layout)}")
    m = best.memory
    lines.append("  per device: " + ", ".join(f"{k[:-6]} {_gb(v)}" for k, v in m.items()
                                              if k != "total_bytes" and v) + f" = {_gb(m['total_bytes'])}")
    if best.bubble:
        lines.append(f"  pipeline bubble {100 * best.bubble:.1f}% of the step ({best.layout['schedule']})")
    for dim, c in best.communication.items():
        if c["bytes"] >= 1e6:
            lines.append(f"  {dim}: {_gb(c['bytes'])} per device per step over {c['link']}, {1e3 * c['seconds']:.1f} ms")
    lines.append(f"  step {best.step_s:.2f} s (compute {best.compute_s:.2f} s at the assumed efficiency), "
                 f"{best.tokens_per_sec:,.0f} tokens/s, MFU {100 * best.mfu:.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchpar plan", description="Per-rank memory, communication, bubble and "
                                 "step time of layouts, by arithmetic; the best layouts of a model on a cluster.")
    ap.add_argument("--model", help="model flavour (search over layouts)")
    ap.add_argument("--config", help="a training config: the prediction for exactly that layout")
    ap.add_argument("--nproc", type=int, default=0, help="ranks for --config")
    ap.add_argument("--gpu", default="H100-80GB", choices=sorted(PRESETS), help="cluster preset (datasheet figures)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=0, help="override the preset's 8")
    ap.add_argument("--memory-gb", type=float, default=0, help="override device memory")
    ap.add_argument("--peak-tflops", type=float, default=0, help="override dense bf16 peak")
    ap.add_argument("--intra-gbps", type=float, default=0, help="GB/s per direction inside a node")
    ap.add_argument("--inter-gbps", type=float, default=0, help="GB/s per direction across nodes")
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp32"),
                    help="compute copy of the weights and activations (state stays fp32, AdamW)")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--efficiency", type=float, default=0.5, help="share of peak FLOP/s the matmuls reach")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seeds", action="store_true", help="recompute the tutorials' worked examples")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    c = PRESETS[a.gpu]
    cluster = Cluster(a.gpus_per_node or c.gpus_per_node, a.memory_gb * 1e9 or c.memory,
                      a.peak_tflops * 1e12 or c.peak_flops, a.intra_gbps * 1e9 or c.intra_bw,
                      a.inter_gbps * 1e9 or c.inter_bw, a.nodes)
    if a.seeds:
        from torchpar.plan.checks import seed_examples

        examples = seed_examples()
        if a.json:
            print(json.dumps(examples, indent=1))
            return 0
        for e in examples:
            print(f"## {e['example']}\n  seed:  {e['seed']}")
            for k, v in e["exact"].items():
                print(f"  {k:<34} {v:,.4g}" if isinstance(v, float) else f"  {k:<34} {v:,}")
            print(f"  note:  {e['note']}\n")
        return 0
    try:
        if a.config:
            cfg = load_config(a.config, [])
            lay, args = layout_from_config(cfg, a.nproc or cluster.world)
            plans = [plan(args, lay, cluster, cfg.training.seq_len, a.efficiency)]
        elif a.model:
            if a.model not in FLAVORS:
                raise ConfigError(f"--model {a.model!r} is unknown.{did_you_mean(a.model, FLAVORS)}")
            args = model_args(a.model)
            plans = search(args, cluster, a.global_batch_size, a.seq_len, 2 if a.param_dtype == "bf16" else 4, a.efficiency)
        else:
            raise ConfigError("give --model FLAVOR (search) or --config FILE --nproc N (one layout)")
    except ConfigError as e:
        print(f"torchpar: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps([p.to_json() for p in plans[: a.top]], indent=1))
        return 0
    if not plans:
        print("no layout divides this world and model")
        return 1
    print(f"{'layout':<84} {'mem/rank':>10} {'fits':>5} {'bubble':>7} {'tok/s':>12} {'MFU':>6}")
    for p in plans[: a.top]:
        print(f"{describe_layout(p.layout):<84} {_gb(p.memory['total_bytes']):>10} {str(p.fits):>5} "
              f"{100 * p.bubble:>6.1f}% {p.tokens_per_sec:>12,.0f} {100 * p.mfu:>5.1f}%")
    print()
    print(explain(args, plans, cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
