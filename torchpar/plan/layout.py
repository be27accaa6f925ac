"""The cluster, and exactly what each rank of a layout holds (parameters, gradients, Adam)."""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field, fields

from torchpar.config import JobConfig
from torchpar.data import chat_data
from torchpar.device import compute_dtype
from torchpar.fault_tolerance import replica_groups
from torchpar.models import adapter, model_args
from torchpar.models.lora import spec as lora_spec
from torchpar.optim import kind_of, param_role
from torchpar.optim import state_bytes as opt_state_bytes
from torchpar.parallel.flat import bucket_elements, flat_layout, flat_shards
from torchpar.parallel.layout import (
    Layout,
    chunk,
    expert_names,
    names_at,
    params_at,
    rank_key,
    rank_param_names,
    rank_params,
    resolve_layout,
    split_of,
    stage_entries,
    trained,
)


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    memory: float  # bytes per device
    peak_flops: float  # dense bf16 FLOP/s per device
    intra_bw: float  # bytes/s per direction per device inside a node
    inter_bw: float  # bytes/s per direction per device across nodes
    host_memory: float  # bytes of CPU memory per node (what CPU offload fills)
    nodes: int = 1
    memory_bw: float = 2e12  # bytes/s of device memory (HBM), what elementwise recomputation costs
    # Measured collectives (torchpar.plan.probe): {"intra:4": {"all_reduce": [latency s, bytes/s], ...}};
    # None: the datasheet bandwidths above, no latency.
    collectives: dict | None = field(default=None, compare=False, hash=False)
    # Measured fixed costs of the model's forward + backward (probe): per block, and per forward
    # (embedding, head, loss, the step's own); 0 for the presets, whose step is FLOPs alone.
    block_overhead: float = 0.0
    forward_overhead: float = 0.0
    overlap: bool = True  # communication overlaps compute as designed (False: a CPU, where gloo computes)
    # Cores each rank has where a host's ranks share its CPU cores (below 1: they take turns, and a
    # rank idle in a pipeline bubble gives its core to the others); 1 where each rank has a device.
    cores_per_rank: float = 1.0
    # Dense FP8 FLOP/s per device (the datasheets'), what FP8 matmuls ([quantize]) run at; 0: a device
    # without FP8 tensor cores, or one not measured, where they are priced at peak_flops.
    peak_fp8_flops: float = 0.0

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


# Datasheet figures. NVLink is quoted as the total of both directions (A100: 600 GB/s); a ring
# moves data one way, so the planner uses half of it. Inter-node: one NIC per GPU. Host memory:
# the DGX systems' 2 TB; a generic PCIe server's 512 GB.
PRESETS = {
    # NVLink3 600 GB/s, HDR 200 Gb/s; HBM2e 2.0 TB/s
    "A100-80GB": Cluster(8, 80e9, 312e12, 300e9, 25e9, 2e12, memory_bw=2.0e12),
    # NVLink4 900 GB/s, NDR 400 Gb/s; HBM3 3.35 TB/s (SXM)
    "H100-80GB": Cluster(8, 80e9, 989e12, 450e9, 50e9, 2e12, memory_bw=3.35e12, peak_fp8_flops=1979e12),
    "H200-141GB": Cluster(8, 141e9, 989e12, 450e9, 50e9, 2e12, memory_bw=4.8e12,  # HBM3e 4.8 TB/s
                          peak_fp8_flops=1979e12),
    # PCIe 4.0 x16; 100 GbE per node; an A100 PCIe's HBM2e 1.9 TB/s
    "PCIe-Ethernet": Cluster(8, 80e9, 312e12, 16e9, 12.5e9 / 8, 512e9, memory_bw=1.9e12),
}


def layout_from_config(cfg: JobConfig, world: int, device: str | None = None) -> tuple[Layout, object,
                                                                                      object]:
    """The exact layout a config gives on ``world`` ranks of ``device`` type (default: this
    machine's; resolved and checked as the trainer does), with the model's adapter and args."""
    model = adapter(cfg.model.name)
    args = model_args(cfg.model)
    dtype = compute_dtype(cfg.training.mixed_precision_param, device)
    lay = resolve_layout(cfg.parallelism, cfg.training, model, args, world, dtype, cfg.optimizer,
                         cfg.data.document_masking, device, cfg.overridden, cfg.quantize,
                         chat_data(cfg.data), cfg.lora, replica_groups(cfg.fault_tolerance),
                         cfg.loss.z_loss > 0)
    return lay, model, args


# Layout fields that change no rank's parameter, gradient or optimizer bytes, nor ZeRO 0-2's peaks
# outside the step: the search prices thousands of layouts that differ in these alone.
_NOT_STATE = frozenset({"local_batch_size", "accum", "microbatch_size", "activation_checkpoint",
                        "activation_checkpoint_every", "compile", "reduce_every_microstep", "cp_method",
                        "sequence_parallel", "loss_parallel", "optimizer", "quantize", "loss_mask", "z_loss",
                        "lora"})


_STATE_FIELDS = tuple(f.name for f in fields(Layout)
                      if f.name not in _NOT_STATE and f.name not in ("mesh", "experts_view", "views"))


def by_state(fn):
    """``fn(model, args, lay, *rest)``, remembered by what of ``lay`` fixes its state bytes (its
    fields but _NOT_STATE's and the mesh, the [optimizer] section's values and which layers LoRA
    adapts)."""
    memo: dict = {}

    @functools.wraps(fn)
    def remembered(model, args, lay: Layout, *rest):
        # (the search calls this ~10 times per layout it prices: the key is read field by field)
        fixed = tuple(getattr(lay, k) for k in _STATE_FIELDS)
        key = (model, args, repr(lay.optimizer), lora_spec(lay.lora), fixed,
               *(tuple(sorted(r.items())) if isinstance(r, dict) else r for r in rest))
        if key not in memo:
            if len(memo) > 100_000:  # (a long-lived process that plans many models)
                memo.clear()
            memo[key] = fn(model, args, lay, *rest)
        value = memo[key]
        return dict(value) if isinstance(value, dict) else value
    return remembered


@by_state
def state_bytes(model, args, lay: Layout, coords: dict[str, int]) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of the rank at ``coords`` (pp, dp_shard, cp,
    tp), as torchpar lays them out: exact, including uneven shards and ZeRO 0-2 padding; the
    optimizer's state from its declaration (torchpar.optim.state_bytes) per piece it updates."""
    pp, tp = coords.get("pp", 0), coords.get("tp", 0)
    local = rank_params(model, args, lay, pp, tp)
    lora = lora_spec(lay.lora)  # (with LoRA only the adapters have gradients and optimizer state)
    if lay.zero_stage == 3:  # FSDP2: dim 0 of each (TP-local) parameter split over dp_shard x cp
        # (an expert stack's, its ep-local experts, over the ranks holding the same experts)
        experts = expert_names(model)
        split = {False: (lay.shard_ranks, lay.shard_index(coords)),
                 True: (lay.expert_shard_ranks, lay.expert_shard_index(coords))}
        pieces = [((chunk(r, *split[name in experts]), c), role, name) for (r, c), role, name in
                  zip(local, _roles(model, args, lay, pp, tp), rank_param_names(model, args, lay, pp))]
        n = sum(r * c for (r, c), _, _ in pieces)
        learned = sum(r * c for (r, c), _, name in pieces if trained(name, lora))
        optim = sum(opt_state_bytes(lay.optimizer, _shape(s, model, args, name), role)
                    for s, role, name in pieces if trained(name, lora))
        # (the frozen ones, a LoRA base, in the compute dtype: see parallel.fsdp.frozen_in)
        return {"param_bytes": 4 * learned + lay.param_dtype_bytes * (n - learned), "grad_bytes": 4 * learned,
                "optim_bytes": optim}
    # ZeRO 0-2 (the flat engine): the compute copy whole (its buffer, padding included); the reduced
    # gradient whole (0, 1) or its owned N-th (2) in the reduction dtype — in bf16 replaced by the
    # fp32 copy the optimizer takes; the optimizer's state of the pieces it updates and, when the
    # compute copy is not fp32, the fp32 master of the owned N-th. Frozen parameters (LoRA's base)
    # are outside the buffer, in the compute dtype, whole.
    n = flat_shards(lay)
    rank = lay.shard_index(coords) if n > 1 else 0
    local, names, frozen = flat_rank_params(model, args, lay, pp, tp)
    roles, whole, starts, bounds = flat_rank_layout(model, args, lay, pp, tp)
    shard = bounds[-1] // n
    held = shard if lay.zero_stage == 2 else shard * n
    grads = 4 * held if lay.reduce_dtype == "float32" else 4 * shard
    master = 4 * shard if lay.param_dtype != "float32" else 0
    sliced = sum(r * c for (r, c), w in zip(local, whole) if not w)
    optim = 0
    if sliced:  # 1-D slices, element-wise state: the owned N-th of the sliced buckets less padding
        padded = math.ceil(sliced / n) * n
        last = (padded - 1) // bucket_elements(lay) * bucket_elements(lay)
        m = (padded - last) // n
        mine = padded // n - m + max(0, min(sliced, last + (rank + 1) * m) - (last + rank * m))
        optim += opt_state_bytes(lay.optimizer, (mine,), "vector") if mine else 0
    for (r, c), role, start, w, name in zip(local, roles, starts, whole, names):  # whole ones in this N-th
        k = bisect.bisect_right(bounds, start) - 1
        if w and (start - bounds[k]) // ((bounds[k + 1] - bounds[k]) // n) == rank:
            optim += opt_state_bytes(lay.optimizer, _shape((r, c), model, args, name), role)
    return {"param_bytes": lay.param_dtype_bytes * (bounds[-1] + frozen), "grad_bytes": grads,
            "optim_bytes": optim + master}


def flat_rank_params(model, args, lay: Layout, pp_rank: int, tp_index: int = 0):
    """(rows, cols) and names of the parameters the flat ZeRO 0-2 buffer of the rank at ``pp_rank``
    / ``tp_index`` holds — the trained ones, in model order — and the elements of the frozen ones
    (LoRA's base), which it keeps outside."""
    lora = lora_spec(lay.lora)
    local = rank_params(model, args, lay, pp_rank, tp_index)
    names = rank_param_names(model, args, lay, pp_rank)
    learned = [trained(name, lora) for name in names]
    frozen = sum(r * c for (r, c), t in zip(local, learned) if not t)
    return ([s for s, t in zip(local, learned) if t], [name for name, t in zip(names, learned) if t], frozen)


def flat_rank_layout(model, args, lay: Layout, pp_rank: int, tp_index: int = 0):
    """The flat ZeRO 0-2 buffer of the rank at ``pp_rank`` / ``tp_index``: each parameter's role,
    whether the optimizer takes it whole, where it starts, and the bucket bounds (as FlatZero
    lays them out: :func:`torchpar.parallel.flat.flat_layout`)."""
    return _flat_rank_layout(model, args, (rank_key(model, args, lay, pp_rank), lay.ep, lay.tp, tp_index),
                             kind_of(lay.optimizer).whole, flat_shards(lay), bucket_elements(lay))


@functools.lru_cache(maxsize=4096)  # (the search prices thousands of layouts with a few buffers)
def _flat_rank_layout(model, args, at: tuple, whole_rule, shards: int, bucket: int):
    # (``at``: the rank's rank_key, ep, tp, tp index; ``whole_rule``: the optimizer's Kind.whole)
    # The buffer holds the trained parameters alone (with LoRA, the adapters).
    learned = [trained(name, at[0][2]) for name in names_at(model, args, at[0])]
    local = [s for s, t in zip(params_at(model, args, *at), learned) if t]
    roles = tuple(r for r, t in zip(_roles_of(model, args, *at), learned) if t)
    whole = [whole_rule is not None and whole_rule(role, 1 if c == 1 else 2)
             for (_, c), role in zip(local, roles)]
    starts, bounds = flat_layout([r * c for r, c in local], shards, bucket, whole)
    return roles, tuple(whole), tuple(starts), tuple(bounds)  # (cached: read-only)


def _roles(model, args, lay: Layout, pp_rank: int, tp_index: int = 0) -> tuple[str, ...]:
    """Each of :func:`rank_params`' parameters' role (torchpar.optim.param_role)."""
    return _roles_of(model, args, rank_key(model, args, lay, pp_rank), lay.ep, lay.tp, tp_index)


@functools.lru_cache(maxsize=4096)
def _roles_of(model, args, key: tuple, ep: int, tp: int, tp_index: int) -> tuple[str, ...]:
    local = params_at(model, args, key, ep, tp, tp_index)
    names = names_at(model, args, key)
    return tuple(param_role(name, 1 if c == 1 else 2, model) for name, (_, c) in zip(names, local))


def _shape(rc: tuple[int, int], model=None, args=None, name: str = "") -> tuple[int, ...]:
    """A parameter's (or its piece's) shape from the adapter's (rows, cols), where vectors are (n, 1)
    and a stack of experts' matrices is (experts, rows x cols): [experts, rows, cols] again, its
    matrix dimension that TP splits (expert_plan) cut to what ``rc`` holds."""
    stack = model.stack_shape(args, name) if model is not None else None
    if stack is None:
        return (rc[0],) if rc[1] == 1 else rc
    module, _, weight = name.rpartition(".")
    dims = list(stack[1:])
    split = model.expert_plan[module][weight] - 1  # (its dimension in the stack, past the experts')
    dims[split] = rc[1] // dims[1 - split]
    return (rc[0], *dims)


@by_state
def transient_bytes(model, args, lay: Layout, pp_rank: int = 0) -> dict[str, int]:
    """ZeRO 0-2's peaks outside the step, on the rank at ``pp_rank``: ``startup_peak`` — the
    engine's buffer and fp32 master while they are filled, one parameter's initial fp32 value at
    a time (the largest, and under TP the local piece cut from it); ``checkpoint_peak`` — a save
    or resume: the steady state and one bucket in fp32 (each rank saves and loads its owned pieces
    in place, chunk by chunk). Zero under ZeRO-3 (FSDP2 already keeps only shards)."""
    if lay.zero_stage == 3:
        return {"startup_peak": 0, "checkpoint_peak": 0}
    state = state_bytes(model, args, lay, {"pp": pp_rank})
    bounds = flat_rank_layout(model, args, lay, pp_rank)[3]
    shard = bounds[-1] // flat_shards(lay)
    master = 4 * shard if lay.param_dtype != "float32" else 0
    bucket = max([bucket_elements(lay), *(b - a for a, b in zip(bounds, bounds[1:]))])
    split = split_of(model, args, lay)
    largest = max(r * c * (1 + (lay.tp > 1 and tp_dim is not None))
                  for s in lay.stage_ids(pp_rank)
                  for _, (r, c), tp_dim in stage_entries(model, args, split, s))
    return {"startup_peak": state["param_bytes"] + master + 4 * largest,
            "checkpoint_peak": sum(state.values()) + 4 * bucket}


def deepspeed_bytes(n_params: int, zero_stage: int, dp: int) -> dict[str, float]:
    """Mixed-precision bytes per rank in DeepSpeed's / Megatron's convention (see module doc)."""
    return {"param_bytes": 2 * n_params / (dp if zero_stage >= 3 else 1),
            "grad_bytes": 2 * n_params / (dp if zero_stage >= 2 else 1),
            "optim_bytes": 12 * n_params / (dp if zero_stage >= 1 else 1)}
