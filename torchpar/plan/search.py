"""Every layout of a model on a cluster, ranked; the explanation; ``torchpar plan``."""

from __future__ import annotations

from torchpar.composition import refusals
from torchpar.console import warn
from torchpar.errors import ConfigError
from torchpar.parallel.layout import Layout, context_problem, job_fields, layout_features
from torchpar.parallel.pipeline import MAX_MICROBATCHES, balanced_split, schedule_problem
from torchpar.parallel.recompute import OPTIONS, option_name
from torchpar.plan.estimate import Plan, device_peak, plan
from torchpar.plan.layout import Cluster

# ------------------------------------------------------------------ search and the command


# Pipeline schedules the search tries: (name, stages per rank).
SEARCHED_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))
# Tokens per step the planner accepts: far beyond any real batch, so a larger one is a typo, and
# its arithmetic stays quick.
MAX_TOKENS_PER_STEP = 10 ** 10


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _degrees(model, args, cluster: Cluster, global_batch: int, seq: int, device: str = "cuda"):
    """(tp, pp, cp, context-parallel method, dp) that divide the world, the model, the batch and
    (cp) the sequence; TP inside a node. A cp > 1 gets all-to-all where the heads split (exact, two
    exchanges a block), else ring; on ``device``, with sequence parallelism, as the trainer would."""
    world = cluster.world
    for tp in _divisors(cluster.gpus_per_node):
        if any(n % tp for n in model.tp_divisors(args).values()):
            continue
        for pp in _divisors(world // tp):
            if pp > args.n_layers:
                continue
            for cp in _divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                method = next((m for m in ("alltoall", "ring")
                               if not context_problem(args, seq, cp, tp, True, m, device)), None)
                if global_batch % dp == 0 and method is not None:
                    yield tp, pp, cp, method, dp


def _layouts(model, args, tp: int, pp: int, cp: int, method: str, dp: int, per_dp: int, param_dtype: str,
             left_out: list, offload_too: bool = True, optimizer=None, device: str = "cuda", quantize=None,
             lora=None):
    """Every layout of these degrees that the composition table lets run (on ``device``): ZeRO
    stage, its shard group (HSDP) and (``offload_too``) offload, expert parallelism (a mixture of
    experts), recomputation, micro-batch and, with a pipeline, the schedule. Pipeline layouts of more
    than MAX_MICROBATCHES microbatches are left out (their schedules take too long to build) and
    counted in ``left_out``."""
    for lay in _every_layout(model, args, tp, pp, cp, method, dp, per_dp, param_dtype, left_out, offload_too,
                             job_fields(optimizer, quantize, lora=lora)):
        if not refusals(layout_features(lay, model, args, device=device)):
            yield lay


def _every_layout(model, args, tp: int, pp: int, cp: int, method: str, dp: int, per_dp: int,
                  param_dtype: str, left_out: list, offload_too: bool, job: dict):

    stages = ((0, False), (1, False), (2, False), (3, False)) + ((3, True),) * offload_too
    # HSDP: ZeRO 1-3 shard over dp_shard (x cp) ranks and replicate over dp_replicate (ZeRO 0
    # replicates over every dp rank either way); any shard group that leaves two or more replicas
    # and shards over something (dp_shard 1 shards over cp alone).
    shardings = [(zero, offload, dp // shard, shard) for zero, offload in stages
                 for shard in (_divisors(dp) if zero else (dp,)) if shard == dp or shard * cp > 1]
    experts = model.experts(args)
    for zero, offload, replicas, shard in shardings:
        if zero in (1, 2, 3) and shard * cp == 1 and not offload:
            continue  # nothing to shard: the same as zero 0
        # Expert parallelism splits the experts over some of the ZeRO-3 shard ranks (dp_shard), each
        # expert then sharded over the rest (the composition table asks ZeRO-3 of it).
        eps = [ep for ep in _divisors(shard) if experts and experts % ep == 0 and (ep == 1 or zero == 3)]
        searched = ((ac, mbs, ep) for ac in OPTIONS.values() for mbs in (1, 2, 4) if per_dp % mbs == 0
                    for ep in eps or [1])
        for (ac, every), mbs, ep in searched:
            common = dict(dp_replicate=replicas, dp_shard=shard, tp=tp, cp=cp, cp_method=method, ep=ep,
                          zero_stage=zero, cpu_offload=offload, activation_checkpoint=ac,
                          activation_checkpoint_every=every, sequence_parallel=True, loss_parallel=True,
                          param_dtype=param_dtype, **job)
            if pp == 1:
                yield Layout(**common, local_batch_size=mbs, accum=per_dp // mbs, microbatch_size=mbs)
                continue
            n_micro = per_dp // mbs
            if n_micro > MAX_MICROBATCHES:
                left_out.append(n_micro)
                continue
            for schedule, v in SEARCHED_SCHEDULES:
                # Fewer microbatches than stages is mostly bubble: not searched.
                if n_micro >= pp and not schedule_problem(schedule, pp, v, args.n_layers, n_micro):
                    yield Layout(**common, pp=pp, local_batch_size=per_dp, microbatch_size=mbs,
                                 schedule=schedule, stages_per_rank=v,
                                 layers_per_stage=balanced_split(model, args, pp * v))


def search(model, args, cluster: Cluster, global_batch: int, seq: int, param_dtype: str = "bfloat16",
           efficiency: float = 0.5, device: str = "cuda", optimizer=None, offload: bool = True,
           quantize=None, lora=None) -> list[Plan]:
    """Every layout of adapter ``model`` with ``args`` that divides the world and the model,
    ranked by estimated tokens/s (layouts that fit first); for a job on ``device`` (CPU offload
    with ``offload``, on GPUs only) with ``optimizer`` (the [optimizer] section; None: AdamW) and
    ``quantize`` (the [quantize] section, FP8; None: off) and ``lora`` (the [lora] section; None: off)."""

    left_out: list[int] = []
    every = layouts(model, args, cluster, global_batch, seq, param_dtype, device, optimizer, offload,
                    left_out, quantize, lora)
    plans = [plan(model, args, lay, cluster, seq, efficiency) for lay in every]
    if left_out:
        warn(f"pipeline layouts of more than {MAX_MICROBATCHES} microbatches per step (up to "
             f"{max(left_out):,} at this batch) are not searched: their schedules take too long to build")
    return sorted(plans, key=ranking)


def ranking(p: Plan) -> tuple:
    """Layouts that fit first, then the fastest; among equally fast ones (communication all hidden
    behind compute ties many) the one needing the least memory, then the one whose communication takes
    the least time on its links."""
    return (not p.fits, -p.tokens_per_sec, device_peak(p.memory),
            sum(c["seconds"] for c in p.communication.values()))


def layouts(model, args, cluster: Cluster, global_batch: int, seq: int, param_dtype: str = "bfloat16",
            device: str = "cuda", optimizer=None, offload: bool = True, left_out: list | None = None,
            quantize=None, lora=None):
    """The layouts :func:`search` prices, one at a time (pipeline layouts it leaves out counted in
    ``left_out``)."""
    left_out = [] if left_out is None else left_out
    for tp, pp, cp, method, dp in _degrees(model, args, cluster, global_batch, seq, device):
        yield from _layouts(model, args, tp, pp, cp, method, dp, global_batch // dp, param_dtype, left_out,
                            offload and device == "cuda", optimizer, device, quantize, lora)


def check_microbatches(lay: Layout) -> None:
    """One config's pipeline: its schedule must be one the planner can build (MAX_MICROBATCHES)."""

    n_micro = lay.micro_steps[1]
    if lay.pp > 1 and n_micro > MAX_MICROBATCHES:
        raise ConfigError(f"training.global_batch_size gives {n_micro:,} pipeline microbatches per step, "
                          f"beyond the {MAX_MICROBATCHES} the planner builds a schedule for; raise "
                          "parallelism.pipeline_parallel_microbatch_size or lower the batch")


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def recompute_name(lay: dict) -> str:
    return option_name(lay["activation_checkpoint"], lay["activation_checkpoint_every"])


def describe_layout(lay: dict) -> str:
    micro = lay["microbatch_size"] if lay["pp"] > 1 else lay["local_batch_size"]
    cp = f"cp {lay['cp']} ({lay['cp_method']}) x " if lay.get("cp", 1) > 1 else ""
    dp = lay["dp_replicate"] * lay["dp_shard"]
    hsdp = (f" (HSDP {lay['dp_replicate']} x {lay['dp_shard']})"
            if lay["dp_replicate"] > 1 and lay["zero_stage"] > 0 else "")
    return (
        f"pp {lay['pp']} x dp {dp}{hsdp} x {cp}tp {lay['tp']}, zero "
        f"{lay['zero_stage']}"
        + (f", ep {lay['ep']}" if lay.get("ep", 1) > 1 else "")
        + (" +offload" if lay["cpu_offload"] else "")
        + f", recompute {recompute_name(lay)}, micro-batch {micro}"
        + (f", {lay['schedule']}" if lay["pp"] > 1 else f", accumulation {lay['accum']}")
    )


# The usual order of reasoning: does DP + ZeRO fit? if not, TP inside a node; then a long sequence
# split over ranks (CP); then PP; offload last.
REASONING = (
    (
        "1. data parallel + ZeRO alone",
        lambda lay: lay["tp"] == 1 and lay["pp"] == 1 and lay["cp"] == 1 and not lay["cpu_offload"],
    ),
    ("2. + tensor parallel inside a node",
     lambda lay: lay["tp"] > 1 and lay["pp"] == 1 and lay["cp"] == 1 and not lay["cpu_offload"]),
    ("3. + context parallel (each sequence split over ranks)",
     lambda lay: lay["cp"] > 1 and lay["pp"] == 1 and not lay["cpu_offload"]),
    ("4. + pipeline parallel", lambda lay: lay["pp"] > 1 and not lay["cpu_offload"]),
    ("5. + CPU offload of the ZeRO-3 state", lambda lay: lay["cpu_offload"]),
)


def _reasoning(plans: list[Plan], cluster: Cluster) -> list[str]:
    """Each step of REASONING up to the first whose smallest layout fits, and its fastest layout."""
    lines = []
    for title, pred in REASONING:
        cands = [p for p in plans if pred(p.layout)]
        if not cands:
            continue
        p = min(cands, key=lambda p: p.memory["total_bytes"])
        verdict = "fits" if p.fits else "does not fit"
        if p.memory["host_bytes_per_node"] > 0.9 * cluster.host_memory:
            verdict += (f" (offload needs {_gb(p.memory['host_bytes_per_node'])} of host memory per node, "
                        f"{_gb(0.9 * cluster.host_memory)} usable)")
        lines.append(f"{title}: smallest is {describe_layout(p.layout)} at {_gb(p.memory['total_bytes'])} "
                     f"per device -> {verdict}")
        if p.fits:
            fastest = next(q for q in plans if q.fits and pred(q.layout))
            exposed = fastest.step_s - fastest.compute_s - fastest.bubble_s
            lines.append(
                f"   the fastest of these: {describe_layout(fastest.layout)}: step {fastest.step_s:.2f} s = "
                f"compute {fastest.compute_s:.2f} s (with any recomputation) + bubble + exposed "
                f"communication {exposed:.2f} s; {fastest.tokens_per_sec:,.0f} tokens/s"
            )
            break
    return lines


def _breakdown(best: Plan) -> list[str]:
    """Where the memory and the step time of one plan go."""
    m = best.memory
    lines = [
        f"fastest that fits: {describe_layout(best.layout)}",
        "  per device: "
        + ", ".join(f"{k[:-6]} {_gb(v)}" for k, v in m.items()
                    if k.endswith("_bytes") and k != "total_bytes" and v)
        + f" -> peak {_gb(m['total_bytes'])}"
        + (" (gradients and activations are not held at once: the larger counts)"
           if m["total_bytes"] < sum(v for k, v in m.items()
                                     if k.endswith("_bytes") and k not in ("total_bytes", "cpu_bytes"))
           else "")
        + (f"; host memory per node {_gb(m['host_bytes_per_node'])}" if m["host_bytes_per_node"] else ""),
    ]
    if m["checkpoint_peak"]:
        lines.append(f"  outside the step: start-up peak {_gb(m['startup_peak'])}, checkpoint save/resume "
                     f"peak {_gb(m['checkpoint_peak'])} (the state and one bucket)")
    if best.bubble:
        lines.append(f"  pipeline bubble {100 * best.bubble:.1f}% of the step ({best.layout['schedule']})")
    for dim, c in best.communication.items():
        if c["bytes"] >= 1e6:
            lines.append(f"  {dim}: {_gb(c['bytes'])} per device per step over {c['link']}, "
                         f"{1e3 * c['seconds']:.1f} ms")
    lines.append(f"  step {best.step_s:.2f} s (compute {best.compute_s:.2f} s at the assumed efficiency), "
                 f"{best.tokens_per_sec:,.0f} tokens/s, MFU {100 * best.mfu:.1f}%")
    return lines


def explain(model, args, plans: list[Plan], cluster: Cluster) -> str:
    """The searched layouts in the usual order of reasoning (REASONING), and what the fastest
    layout that fits costs."""
    n = model.num_params(args)
    lay = plans[0].layout
    world = lay["pp"] * lay["dp_replicate"] * lay["dp_shard"] * lay["cp"] * lay["tp"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    lines = [
        f"model: {size} parameters x 16 bytes (weights, gradients, Adam) = {_gb(16 * n)}; {world} devices of "
        f"{_gb(cluster.memory)} ({_gb(0.9 * cluster.memory)} usable).",
        *_reasoning(plans, cluster),
    ]
    fitting = [p for p in plans if p.fits]
    if not fitting:
        lines.append("nothing fits: more devices, a shorter sequence or a smaller micro-batch.")
        return "\n".join(lines)
    return "\n".join(lines + _breakdown(fitting[0]) + _recompute_choices(fitting[0], plans))


def _recompute_choices(best: Plan, plans: list[Plan]) -> list[str]:
    """The same layout under each recomputation policy: memory against extra step time."""
    keys = ("activation_checkpoint", "activation_checkpoint_every")
    same = {recompute_name(p.layout): p for p in plans
            if {k: v for k, v in p.layout.items() if k not in keys}
            == {k: v for k, v in best.layout.items() if k not in keys}}
    same = dict(sorted(same.items(), key=lambda kv: -kv[1].memory["total_bytes"]))
    base = same.get("none", best)
    return ["  recomputation, the layout otherwise the same: " + "; ".join(
        f"{name} {'fits' if p.fits else 'does not fit'} at {_gb(p.memory['total_bytes'])}, "
        f"{100 * (p.step_s / base.step_s - 1):+.0f}% step time" for name, p in same.items())]


OVERRIDES = ("--memory-gb", "--host-memory-gb", "--peak-tflops", "--intra-gbps", "--inter-gbps")
