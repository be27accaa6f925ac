"""One layout's activations, communication per mesh dimension, bubble and step time."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from torchpar.config import JobConfig
from torchpar.models import flops_per_token
from torchpar.plan.layout import (PRESETS, Cluster, Layout, _split, _stage_ids, layout_from_config, rank_coords,
                                  rank_params, stage_params, state_bytes)

PCIE_BW = 25e9  # host <-> device, PCIe 4.0 x16, per direction
CPU_MEMORY_BW = 100e9  # a server socket's DRAM bandwidth, for the offloaded optimizer step


# ------------------------------------------------------------------ activations


def layer_activation_bytes(args, seq: int, batch: int, lay: Layout, act_bytes: int) -> float:
    """Activations one transformer layer keeps for backward, per microbatch (Korthikanti et al.
    2022, eqs. 1-6; their constants assume 2-byte activations, scaled here by ``act_bytes`` / 2).
    The 5as/h term is the attention score matrix: absent with fused attention (SDPA), and
    what selective recomputation removes."""
    s, b, h, a, t = seq, batch, args.dim, args.n_heads, lay.tp
    scores = 0 if lay.fused_attention else 5 * a * s / h
    if lay.activation_checkpoint == "full":
        per = 2 / (t if lay.sequence_parallel else 1)  # only the layer input
    elif lay.sequence_parallel:
        per = (34 + (0 if lay.activation_checkpoint == "selective" else scores)) / t
    else:
        per = 10 + 24 / t + (0 if lay.activation_checkpoint == "selective" else scores / t)
    return s * b * h * per * act_bytes / 2


@functools.lru_cache(maxsize=None)
def _actions(schedule: str, pp: int, n_micro: int, v: int):
    from torchpar.parallel.bubble import schedule_actions, schedule_order

    order, num_stages = schedule_order(schedule, pp, n_micro, v)
    return schedule_actions(schedule, order, pp, n_micro), num_stages


def in_flight(lay: Layout, n_micro: int, pp_rank: int, actions: dict | None = None) -> float:
    """The most microbatch-stages whose activations a rank holds at once, weighted by the
    stage's share of the rank's layers — read off the schedule's own action order (``actions``:
    a running pipeline's own, else built on a fake process group)."""
    if lay.pp == 1:
        return 1.0
    acts = actions or _actions(lay.schedule, lay.pp, n_micro, lay.stages_per_rank)[0]
    held, peak = {}, 0
    for kind, stage, _mb in acts[pp_rank]:
        if kind == "F":
            held[stage] = held.get(stage, 0) + 1
        elif kind in ("B", "I"):
            held[stage] -= 1
        peak = max(peak, sum(held.values()))
    return float(peak) / len(_stage_ids(lay, pp_rank))


# ------------------------------------------------------------------ the plan


@dataclass
class Plan:
    layout: dict
    memory: dict  # per-rank bytes by part (the heaviest pipeline rank)
    communication: dict  # per mesh dimension: bytes sent per rank per step, seconds, link
    bubble: float
    compute_s: float
    step_s: float
    tokens_per_sec: float
    mfu: float
    fits: bool

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def micro_steps(lay: Layout) -> tuple[int, int]:
    """(sequences per forward, forwards per step): pipeline microbatches, or accumulation steps."""
    if lay.pp > 1:
        return lay.microbatch_size, lay.local_batch_size * lay.accum // lay.microbatch_size
    return lay.local_batch_size, lay.accum


def plan(args, lay: Layout, cluster: Cluster, seq: int, efficiency: float = 0.5, headroom: float = 0.9,
         actions: dict | None = None) -> Plan:
    act_bytes = lay.param_dtype_bytes
    micro_batch, n_micro = micro_steps(lay)
    split = _split(args, lay)

    # Memory of each pipeline rank (coordinate 0 elsewhere: the largest shards); keep the heaviest.
    best = None
    for pp_rank in range(lay.pp):
        coords = {"pp": pp_rank, "dp_shard": 0, "tp": 0}
        mem = dict(state_bytes(args, lay, coords))
        stages = _stage_ids(lay, pp_rank)
        layers = sum(split[s] for s in stages)
        per_layer = layer_activation_bytes(args, seq, micro_batch, lay, act_bytes)
        mem["activation_bytes"] = per_layer * layers * in_flight(lay, n_micro, pp_rank, actions)
        has_head = (len(split) - 1) in stages
        # Transients: fp32 logits and their gradient on the head's rank; FSDP2's gathered block
        # (and the next one, prefetched) in the compute dtype.
        mem["logits_bytes"] = 2 * 4 * micro_batch * seq * args.vocab_size / lay.tp if has_head else 0
        block = sum(r * c for _, (r, c), _ in stage_params(args, False, False, 1)) / lay.tp
        mem["gathered_bytes"] = 2 * block * lay.param_dtype_bytes if lay.zero_stage == 3 and lay.dp_shard > 1 else 0
        cpu = {k: mem.pop(k) for k in ("param_bytes", "grad_bytes", "optim_bytes")} if lay.cpu_offload else {}
        mem["total_bytes"] = sum(mem.values())
        # What CPU offload moves off the device (not in the device total).
        mem.update({k: 0 for k in cpu}, cpu_bytes=sum(cpu.values()))
        if best is None or mem["total_bytes"] > best["total_bytes"]:
            best = mem
    comm = communication(args, lay, cluster, seq)
    tokens = lay.dp * lay.local_batch_size * lay.accum * seq
    flops = flops_per_token(args, seq) * tokens * (4 / 3 if lay.activation_checkpoint == "full" else 1)
    compute = flops / lay.world / (cluster.peak_flops * efficiency)
    bubble = pipeline_bubble(lay, n_micro, actions)
    # torchpar reduces ZeRO 0-2 gradients after backward (exposed); FSDP2 overlaps with compute;
    # TP collectives sit on the critical path; pipeline sends are mostly hidden (counted fully).
    dp_s = sum(comm.get(d, {}).get("seconds", 0.0) for d in ("dp", "dp_shard", "dp_replicate"))
    exposed = sum(comm.get(d, {}).get("seconds", 0.0) for d in ("tp", "pp", "world"))
    exposed += max(0.0, dp_s - compute) if lay.zero_stage == 3 else dp_s
    if lay.cpu_offload:
        # Sharded parameters cross PCIe to the device for every all-gather, gradients back once,
        # and Adam runs on the CPU (counted as memory-bound: 16 bytes read + written per parameter).
        host = state_bytes(args, lay, {"pp": 0, "dp_shard": 0, "tp": 0})
        moved = host["param_bytes"] * (2 * lay.accum if lay.pp == 1 else 1) + host["grad_bytes"]
        comm["offload"] = {"bytes": moved, "seconds": moved / PCIE_BW, "link": "PCIe"}
        exposed += moved / PCIE_BW + 2 * (host["param_bytes"] + host["optim_bytes"]) / CPU_MEMORY_BW
    step = compute / (1 - bubble) + exposed
    tps = tokens / step
    mfu = flops_per_token(args, seq) * tps / (cluster.peak_flops * lay.world)
    return Plan(dataclasses.asdict(lay), best, comm, bubble, compute, step, tps, mfu,
                best["total_bytes"] <= headroom * cluster.memory)


def pipeline_bubble(lay: Layout, n_micro: int, actions: dict | None = None) -> float:
    """Bubble fraction from the schedule's action order (the same as `torchpar schedule`)."""
    if lay.pp == 1:
        return 0.0
    from torchpar.parallel.bubble import simulate

    acts, num_stages = _actions(lay.schedule, lay.pp, n_micro, lay.stages_per_rank) if actions is None \
        else (actions, lay.pp * lay.stages_per_rank)
    return simulate(acts, num_stages)["bubble"]


def _link(cluster: Cluster, stride: int, size: int) -> tuple[str, float]:
    """A mesh dimension spans ``stride * size`` consecutive ranks: inside a node if they fit."""
    return ("intra-node", cluster.intra_bw) if stride * size <= cluster.gpus_per_node else ("inter-node", cluster.inter_bw)


def _ring(kind: str, n: int) -> float:
    """Share of the payload a ring sends per rank (the ledger uses the same factors)."""
    from torchpar.parallel.ledger import FACTOR

    return FACTOR[kind](n) if n > 1 else 0.0


def communication(args, lay: Layout, cluster: Cluster, seq: int, pp_rank: int = 0) -> dict:
    """Bytes the rank at pipeline position ``pp_rank`` sends per step through each mesh
    dimension (ring algorithms), the seconds that takes and the links it crosses. Counted
    collective by collective as torchpar issues them (checked by tests/test_plan.py against a
    ledger of a real run)."""
    micro_batch, n_micro = micro_steps(lay)
    split = _split(args, lay)
    stages = _stage_ids(lay, pp_rank)
    layers = sum(split[s] for s in stages)
    first, last = 0 in stages, len(split) - 1 in stages
    act = lay.param_dtype_bytes
    hidden = micro_batch * seq * args.dim * act  # one [b, s, d] activation
    sent: dict[str, float] = {}

    def add(dim: str, kind: str, payload: float, n: int, times: float = 1) -> None:
        if n > 1:
            sent[dim] = sent.get(dim, 0.0) + times * _ring(kind, n) * payload

    # The trainer's own: the loss and the global gradient norm, one fp32 scalar each, over all ranks.
    add("world", "all_reduce", 4, lay.world, times=2)
    t = lay.tp
    if t > 1:
        # Per layer and micro-step, forward and backward: with sequence parallel 4 all-gathers + 4
        # reduce-scatters of the activation; without, 4 all-reduces (same bytes). The embedding
        # and the head add one pair each.
        pairs = 4 * layers + first + last
        if lay.sequence_parallel:
            add("tp", "all_gather", hidden, t, pairs * n_micro)
            add("tp", "reduce_scatter", hidden, t, pairs * n_micro)
            norms = 2 * layers + last  # replicated norm weights: partial gradients all-reduced once
            add("tp", "all_reduce", 4 * args.dim, t, norms)
        else:
            add("tp", "all_reduce", hidden, t, pairs * n_micro)
        if last:
            if lay.loss_parallel:  # cross-entropy on vocab shards: max, sum of exp, target logit
                add("tp", "all_reduce", micro_batch * seq * 4, t, 3 * n_micro)
            else:
                add("tp", "all_gather", micro_batch * seq * args.vocab_size * 4, t, n_micro)
    n, r = lay.dp_shard, lay.dp_replicate
    if lay.dp > 1:
        local = rank_params(args, lay, pp_rank)
        total = sum(a * b for a, b in local)
        if lay.zero_stage in (0, 1, 2):
            shards = n if lay.zero_stage in (1, 2) else 1
            flat = 4 * math.ceil(total / shards) * shards  # the padded fp32 buffer
            if lay.zero_stage == 2 and shards > 1:
                add("dp_shard", "reduce_scatter", flat, n)
                add("dp_replicate", "all_reduce", flat / n, r)
            else:
                add("dp", "all_reduce", flat, lay.dp)
            if shards > 1:
                add("dp_shard", "all_gather", flat, n)
        else:
            # FSDP2 units: each block, and the root (embedding, final norm, head). A unit's
            # collectives carry every parameter padded to a multiple of dp_shard rows.
            def unit_bytes(shapes, dtype_bytes):
                return dtype_bytes * sum(math.ceil(a / n) * n * b for a, b in shapes)

            per_block = len(stage_params(args, False, False, 1))
            blocks = [local[i:i + per_block] for i in range(int(first), int(first) + layers * per_block, per_block)]
            root = local[:int(first)] + local[int(first) + layers * per_block:]
            # Without a pipeline each micro-step gathers every unit, and the blocks again for
            # backward; under a pipeline nothing reshards until the step ends (one gather each).
            gathers = lay.accum if lay.pp == 1 else 1
            for unit in blocks:
                add("dp_shard", "all_gather", unit_bytes(unit, act), n, 2 * gathers if lay.pp == 1 else 1)
                add("dp_shard", "reduce_scatter", unit_bytes(unit, 4), n)
            if root:
                add("dp_shard", "all_gather", unit_bytes(root, act), n, gathers)
                add("dp_shard", "reduce_scatter", unit_bytes(root, 4), n)
            for unit in blocks + ([root] if root else []):
                add("dp_replicate", "all_reduce", unit_bytes(unit, 4) / n, r)
    if lay.pp > 1:
        # Each microbatch crosses every stage boundary forward (activations) and back (their
        # gradients); a rank sends from each of its stages that has a neighbour.
        sends = sum((s < len(split) - 1) + (s > 0) for s in stages) * n_micro * hidden
        sent["pp"] = sends
    # Links: mesh dims (pp, dp_replicate, dp_shard, tp), tp innermost; a dim is intra-node when
    # all the ranks it spans fit in one node.
    stride = {"tp": (1, t), "dp_shard": (t, n), "dp_replicate": (t * n, r), "dp": (t, lay.dp),
              "pp": (t * lay.dp, lay.pp), "world": (1, lay.world)}
    out = {}
    for dim, b in sent.items():
        link, bw = _link(cluster, *stride[dim])
        out[dim] = {"bytes": b, "seconds": b / bw, "link": link}
    return out


def predict_for_trainer(cfg: JobConfig, world: int, actions: dict | None = None) -> dict:
    """What the trainer logs at its first step: each rank's predicted state bytes, the predicted
    device peak (state + activations + transients) of the heaviest rank. ``actions``: the
    running pipeline's schedule (no extra process group is made inside a running job)."""
    lay, args = layout_from_config(cfg, world)
    per_rank = [state_bytes(args, lay, rank_coords(lay, r)) for r in range(world)]
    peak = plan(args, lay, PRESETS["H100-80GB"], cfg.training.seq_len, actions=actions).memory["total_bytes"]
    return {"per_rank": per_rank, "peak_bytes": peak}
