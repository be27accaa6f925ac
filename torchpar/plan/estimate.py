"""One layout's memory per rank, pipeline bubble and step time (its communication:
:mod:`torchpar.plan.communication`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from torchpar.models.lora import first_adapted_block, matmul_flops
from torchpar.models.lora import flops_per_token as lora_flops
from torchpar.models.lora import spec as lora_spec
from torchpar.parallel.bubble import schedule_actions, simulate
from torchpar.parallel.flat import IN_FLIGHT, flat_shards
from torchpar.parallel.float8 import float8_weights, gathered_in_float8
from torchpar.parallel.layout import Layout, expert_names, split_of
from torchpar.parallel.pipeline import SPLIT_BACKWARD, schedule_order
from torchpar.parallel.recompute import recomputed
from torchpar.plan.activations import ends_bytes, held_bytes, stage_activation_bytes
from torchpar.plan.communication import communication, exposed_seconds, optimizer_seconds
from torchpar.plan.layout import Cluster, by_state, flat_rank_layout, state_bytes, transient_bytes

# ------------------------------------------------------------------ activations and recomputation


def recompute_flops_per_token(model, args, lay: Layout, seq: int) -> float:
    """Forward FLOPs run again in backward, per token: the blocks ``full`` recomputes (their
    matmuls and attention; under LoRA, none before the first adapted block: they run no backward).
    Selective recomputation keeps every matmul's and attention's output and reruns elementwise work
    only, O(d) FLOPs per token against the matmuls' O(d²): it is charged as memory traffic instead
    (:func:`_elementwise_recompute_s`)."""

    if lay.activation_checkpoint != "full":
        return 0.0

    blocks = args.n_layers + model.prediction_depths(args)
    start = first_adapted_block(model, args, lora_spec(lay.lora))  # (LoRA: none before it runs backward)
    wrapped = sum(recomputed(i, "full", lay.activation_checkpoint_every) for i in range(start, blocks))
    block, _head = model.matmul_params(args)
    # A backward split into input- and weight-gradient passes recomputes the block in each.
    passes = 2 if lay.pp > 1 and lay.schedule in SPLIT_BACKWARD else 1
    return passes * wrapped * (2 * block + 4 * seq * args.dim)


def _elementwise_recompute_s(model, args, lay: Layout, seq: int, cluster: Cluster) -> float:
    """Selective recomputation's cost, which is memory traffic rather than FLOPs: what it no
    longer keeps is written again in backward, from inputs of about the same size — twice those
    bytes through device memory, per block of the rank and per forward of the step."""
    if lay.activation_checkpoint != "selective":
        return 0.0
    micro_batch, n_micro = lay.micro_steps
    dropped = max(0.0, held_bytes(model, args, lay, micro_batch, seq, "none")
                  - held_bytes(model, args, lay, micro_batch, seq, "selective"))
    # (under LoRA, no block before the first adapted one runs backward: none recomputes)
    frozen = first_adapted_block(model, args, lora_spec(lay.lora))
    blocks = args.n_layers + model.prediction_depths(args) - frozen
    return 2 * dropped * blocks / lay.pp * n_micro / cluster.memory_bw


@functools.lru_cache(maxsize=None)
def _actions(schedule: str, pp: int, n_micro: int, v: int):

    order, num_stages = schedule_order(schedule, pp, n_micro, v)
    return schedule_actions(schedule, order, pp, n_micro), num_stages


def in_flight(lay: Layout, n_micro: int, pp_rank: int, actions: dict | None = None) -> float:
    """The most microbatch-stages whose activations a rank holds at once, weighted by the
    stage's share of the rank's layers — read off the schedule's own action order (``actions``:
    a running pipeline's own, else built on a fake process group)."""
    if lay.pp == 1:
        return 1.0
    if actions is None:
        peak = _held_peak(lay.schedule, lay.pp, n_micro, lay.stages_per_rank, pp_rank)
    else:
        peak = _peak(actions[pp_rank])
    return float(peak) / len(lay.stage_ids(pp_rank))


@functools.lru_cache(maxsize=None)  # (the search asks for a few schedules thousands of times)
def _held_peak(schedule: str, pp: int, n_micro: int, v: int, pp_rank: int) -> int:
    return _peak(_actions(schedule, pp, n_micro, v)[0][pp_rank])


def _peak(rank_actions) -> int:
    """The most microbatch-stages a rank's actions hold forward activations of at once."""
    held, peak = {}, 0
    for kind, stage, _mb in rank_actions:
        if kind == "F":
            held[stage] = held.get(stage, 0) + 1
        elif kind in ("B", "I"):
            held[stage] -= 1
        peak = max(peak, sum(held.values()))
    return peak


# ------------------------------------------------------------------ the plan


@dataclass
class Plan:
    layout: dict
    memory: dict  # per-rank bytes by part (the heaviest pipeline rank)
    communication: dict  # per mesh dimension: bytes sent per rank per step, seconds, link
    bubble: float  # the schedule's idle share of a pipeline rank's step
    compute_s: float
    bubble_s: float  # the wall time the bubble adds to the step on this cluster
    step_s: float
    tokens_per_sec: float
    mfu: float
    fits: bool

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def rank_memory(model, args, lay: Layout, seq: int, pp_rank: int, actions: dict | None = None) -> dict:
    """Device bytes of the rank at pipeline position ``pp_rank`` (coordinate 0 elsewhere: the
    largest shards), by part; ``total_bytes`` is the peak (their sum, less gradients and activations
    that are never held at once), ``cpu_bytes`` what offload moves off."""
    micro_batch, n_micro = lay.micro_steps
    split = split_of(model, args, lay)
    mem = dict(state_bytes(model, args, lay, {"pp": pp_rank, "dp_shard": 0, "tp": 0}))
    stages = lay.stage_ids(pp_rank)
    has_head = (len(split) - 1) in stages
    depths = model.prediction_depths(args)  # (their blocks on the head's stage)
    held = sum(stage_activation_bytes(model, args, lay, micro_batch, seq, sum(split[:s]), split[s])
               for s in stages) + (stage_activation_bytes(model, args, lay, micro_batch, seq, args.n_layers,
                                                          depths) if has_head and depths else 0)
    held += ends_bytes(model, args, lay, micro_batch, seq, 0 in stages, has_head)
    mem["activation_bytes"] = held * in_flight(lay, n_micro, pp_rank, actions)
    # Transients: on the head's rank, as backward starts, the loss's fp32 log-softmax (held for
    # backward), the gradient reaching it and the one it returns — three logits-sized tensors,
    # vocab-sharded with loss parallelism, and each prediction depth's log-softmax; FSDP2's
    # gathered block (and the next one, prefetched) in the compute dtype.
    logits = 4 * micro_batch * (seq // lay.cp) * args.vocab_size / (lay.tp if lay.loss_parallel else 1)
    mem["logits_bytes"] = (3 + depths) * logits if has_head else 0
    # (under expert parallelism a block gathers only its rank's experts; FP8 all-gather, 1 byte
    # per converted weight's element)
    experts, last = expert_names(model), args.n_layers - 1
    fp8 = gathered_in_float8(model, args, lay)
    block = sum(r * c / (lay.ep if name in experts else 1)
                * (1 if f"layers.{last}.{name}" in fp8 else lay.param_dtype_bytes)
                for name, (r, c), _ in model.block_params(args)) / lay.tp
    mem["gathered_bytes"] = 2 * block if lay.zero_stage == 3 and lay.shard_ranks > 1 else 0
    # ZeRO-3 accumulating unsharded: a full fp32 gradient of this rank's layers between micro-steps.
    unsharded = lay.zero_stage == 3 and lay.pp == 1 and lay.accum > 1 and not lay.reduce_every_microstep
    mem["unsharded_grad_bytes"] = mem["grad_bytes"] * lay.shard_ranks if unsharded else 0  # (trained, fp32)
    cpu = {k: mem.pop(k) for k in ("param_bytes", "grad_bytes", "optim_bytes")} if lay.cpu_offload else {}
    flat = _flat_buckets(model, args, lay, pp_rank) if lay.zero_stage < 3 else 0
    mem["total_bytes"] = sum(mem.values()) - _not_at_once(mem, lay, n_micro, flat)
    mem.update({k: 0 for k in cpu}, cpu_bytes=sum(cpu.values()))
    return mem


@by_state
def _flat_buckets(model, args, lay: Layout, pp_rank: int) -> float:
    """ZeRO 0-2's gradient storage as backward ends: the whole flat gradient (stages 0, 1), or
    (stage 2) the owned shard, the buckets in flight and the one being filled, and up to a block's
    gradients more: a block's gradients arrive in backward's order, not the buffer's, so complete
    buckets wait for the block's last one before they are reduced, in order."""

    bounds = flat_rank_layout(model, args, lay, pp_rank)[3]
    whole = lay.reduce_dtype_bytes * bounds[-1]
    if lay.zero_stage != 2 or len(bounds) < 2:  # (no bucket: a stage LoRA leaves without adapters)
        return whole
    block = lay.reduce_dtype_bytes * sum(r * c for _, (r, c), _ in model.block_params(args)) / lay.tp
    bucket = lay.reduce_dtype_bytes * max(b - a for a, b in zip(bounds, bounds[1:]))
    return min(whole, whole / flat_shards(lay) + (IN_FLIGHT + 1) * bucket + block)


def _not_at_once(mem: dict, lay: Layout, n_micro: int, flat_grad_bytes: float) -> float:
    """Bytes of the sum of parts never held at the same time (negative: a transient no part
    lists). Backward frees activations as it makes gradients, so the peak is the larger of two
    phases: as backward starts, the activations and the loss's transients (plus, with accumulation
    or a pipeline, the gradients of earlier microbatches: per parameter under ZeRO 0-2); as it
    ends, the gradients — under ZeRO 0-2 the buckets they were copied into (:func:`_flat_buckets`)."""
    grads = mem.get("grad_bytes", 0)  # 0 when offloaded (then on the host)
    flat_engine = lay.zero_stage < 3
    # (ZeRO 0-2 accumulate per-parameter gradients in fp32 whatever the compute dtype)
    kept = (mem["param_bytes"] * 4 / lay.param_dtype_bytes if flat_engine else grads) if n_micro > 1 else 0
    start = mem["activation_bytes"] + mem["logits_bytes"] + kept
    end = flat_grad_bytes if flat_engine else grads
    return grads + mem["activation_bytes"] + mem["logits_bytes"] - max(start, end)


def plan(model, args, lay: Layout, cluster: Cluster, seq: int, efficiency: float = 0.5, headroom: float = 0.9,
         actions: dict | None = None) -> Plan:
    """Memory (the heaviest pipeline rank), communication, bubble and step time of one layout
    of adapter ``model`` with ``args``."""
    memory, fits = memory_of(model, args, lay, cluster, seq, headroom, actions)
    comm = communication(model, args, lay, cluster, seq)
    tokens = lay.dp * lay.local_batch_size * lay.accum * seq
    per_token = lora_flops(model, args, seq, lora_spec(lay.lora))
    flops = (per_token + recompute_flops_per_token(model, args, lay, seq)) * tokens
    # FP8 layers' matmuls at the FP8 peak, where the device has one: 6 FLOPs per weight element and
    # token (forward and both backward products), fewer for LoRA's frozen base
    factor = matmul_flops(model, args, lora_spec(lay.lora))
    fp8 = (sum(factor(name) * n for name, n in float8_weights(model, args, lay).items()) * tokens
           if cluster.peak_fp8_flops else 0)
    compute = (flops - fp8) / lay.world / (cluster.peak_flops * efficiency)
    if fp8:
        compute += fp8 / lay.world / (cluster.peak_fp8_flops * efficiency)
    compute += _elementwise_recompute_s(
        model, args, lay, seq, cluster) + optimizer_seconds(model, args, lay, cluster, efficiency)
    n_micro = lay.micro_steps[1]
    # A measured machine's fixed costs: each forward + backward of the busiest rank's blocks.
    compute += n_micro * (max(split_of(model, args, lay)) * lay.stages_per_rank * cluster.block_overhead
                          + cluster.forward_overhead)
    bubble = pipeline_bubble(lay, n_micro, actions)
    # Where ranks share cores, a rank idle in the bubble gives its core to the others: the bubble
    # costs wall time only where fewer ranks than cores are busy.
    busy = compute * max(1.0, min(1.0, cluster.cores_per_rank) / (1 - bubble))
    step = busy + exposed_seconds(model, args, lay, comm, compute, cluster.overlap)
    tps = tokens / step
    mfu = per_token * tps / (cluster.peak_flops * lay.world)
    return Plan(lay.to_dict(), memory, comm, bubble, compute, busy - compute, step, tps, mfu, fits)


def memory_of(model, args, lay: Layout, cluster: Cluster, seq: int, headroom: float = 0.9,
              actions: dict | None = None) -> tuple[dict, bool]:
    """A layout's memory (the heaviest pipeline rank's, with its host bytes per node and ZeRO
    0-2's peaks outside the step) and whether it fits ``headroom`` of the cluster's device and
    host memory: :func:`plan`'s memory, alone (a search for any layout that fits needs no more)."""
    memory = max((rank_memory(model, args, lay, seq, r, actions) for r in range(lay.pp)),
                 key=lambda m: m["total_bytes"])
    # Offload moves the state into the node's CPU memory, which its ranks share.
    memory["host_bytes_per_node"] = memory["cpu_bytes"] * min(lay.world, cluster.gpus_per_node)
    # Outside the step: ZeRO 0-2's start-up and checkpoint peaks, which must fit too.
    memory.update(max((transient_bytes(model, args, lay, r) for r in range(lay.pp)),
                      key=lambda t: t["checkpoint_peak"]))
    fits = (device_peak(memory) <= headroom * cluster.memory
            and memory["host_bytes_per_node"] <= headroom * cluster.host_memory)
    return memory, fits


def device_peak(memory: dict) -> float:
    """A plan's device peak: the step's, or outside it ZeRO 0-2's start-up or checkpoint peak."""
    return max(memory["total_bytes"], memory["startup_peak"], memory["checkpoint_peak"])


def pipeline_bubble(lay: Layout, n_micro: int, actions: dict | None = None) -> float:
    """Bubble fraction from the schedule's action order (the same as `torchpar schedule`)."""
    if lay.pp == 1:
        return 0.0
    if actions is None:
        return _bubble(lay.schedule, lay.pp, n_micro, lay.stages_per_rank)
    return simulate(actions, lay.num_stages)["bubble"]


@functools.lru_cache(maxsize=None)  # (the search asks for a few schedules thousands of times)
def _bubble(schedule: str, pp: int, n_micro: int, v: int) -> float:
    return simulate(*_actions(schedule, pp, n_micro, v))["bubble"]
