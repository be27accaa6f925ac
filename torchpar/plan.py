"""The planner: per-rank memory, communication, bubble and step time of a layout, by arithmetic.

    torchpar plan --model 70B --nodes 4 --gpus-per-node 8 --gpu H100-80GB --global-batch-size 512 --seq-len 4096
    torchpar plan --config train_configs/debug_model.toml --nproc 2      # one exact config
    torchpar plan --seeds                                                 # the tutorials' worked examples

Byte convention (torchpar's, which the trainer's measurements are checked against): parameters,
gradients and both Adam moments are fp32 — 4 + 4 + 8 = 16 bytes per parameter — with bf16 only
as compute copies (FSDP2's MixedPrecisionPolicy). DeepSpeed and Megatron count the same 16
bytes differently under mixed precision: 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master +
two moments), and their ZeRO-1 shards the 12, ZeRO-2 also the 2 of gradients, ZeRO-3 also the 2
of parameters. :func:`deepspeed_bytes` gives that convention for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from dataclasses import dataclass

from torchpar.config import ConfigError, JobConfig, did_you_mean, load_config
from torchpar.models import FLAVORS, flops_per_token, model_args, num_params


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    memory: float  # bytes per device
    peak_flops: float  # dense bf16 FLOP/s per device
    intra_bw: float  # bytes/s per direction per device inside a node
    inter_bw: float  # bytes/s per direction per device across nodes
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


# Datasheet figures. NVLink is quoted as the total of both directions (A100: 600 GB/s); a ring
# moves data one way, so the planner uses half of it. Inter-node: one NIC per GPU.
PRESETS = {
    "A100-80GB": Cluster(8, 80e9, 312e12, 300e9, 25e9),  # NVLink3 600 GB/s, HDR 200 Gb/s
    "H100-80GB": Cluster(8, 80e9, 989e12, 450e9, 50e9),  # NVLink4 900 GB/s, NDR 400 Gb/s
    "H200-141GB": Cluster(8, 141e9, 989e12, 450e9, 50e9),
    "PCIe-Ethernet": Cluster(8, 80e9, 312e12, 16e9, 12.5e9 / 8),  # PCIe 4.0 x16; 100 GbE per node
}


PCIE_BW = 25e9  # host <-> device, PCIe 4.0 x16, per direction
CPU_MEMORY_BW = 100e9  # a server socket's DRAM bandwidth, for the offloaded optimizer step


def chunk(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when torch.chunk / DTensor Shard split ``n`` into ``parts``."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


def stage_params(args, first: bool, last: bool, layers: int) -> list[tuple[str, tuple[int, int], int | None]]:
    """(name, 2-D shape, TP-sharded dim or None) of one pipeline stage's parameters — the model
    file's modules and torchpar's TP plan (parallel/tensor.py)."""
    d, kv, hid = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden
    out = []
    if first:
        out.append(("tok_embeddings", (args.vocab_size, d), 0))  # row-wise: vocab rows
    block = [("wq", (d, d), 0), ("wk", (kv, d), 0), ("wv", (kv, d), 0), ("wo", (d, d), 1),
             ("w1", (hid, d), 0), ("w3", (hid, d), 0), ("w2", (d, hid), 1),
             ("attention_norm", (d, 1), None), ("ffn_norm", (d, 1), None)]
    out += block * layers
    if last:
        out.append(("norm", (d, 1), None))
        if not (args.tie_embeddings and first):
            out.append(("output", (args.vocab_size, d), 0))  # column-wise: vocab rows
    return out


@dataclass
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    zero_stage: int = 0
    local_batch_size: int = 1  # sequences per dp rank per micro-step
    accum: int = 1
    microbatch_size: int = 1  # pipeline microbatch
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    activation_checkpoint: str = "none"  # none | selective | full (selective: planner only)
    sequence_parallel: bool = True
    loss_parallel: bool = True
    param_dtype_bytes: int = 4  # compute copy dtype: 4 fp32, 2 bf16
    layers_per_stage: tuple = ()
    cpu_offload: bool = False  # ZeRO-3: sharded parameters, gradients and Adam live on the CPU
    fused_attention: bool = True  # SDPA keeps no s x s score matrix for backward

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp


def layout_from_config(cfg: JobConfig, world: int) -> tuple[Layout, object]:
    """The exact layout a config gives on ``world`` ranks (validated like the trainer does)."""
    from torchpar.parallel import validate_layout
    from torchpar.parallel.dims import ParallelDims

    args = model_args(cfg.model.flavor, cfg.model.n_layers)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    accum = validate_layout(cfg, dims, args)
    par, tr = cfg.parallelism, cfg.training
    split = ()
    v = 1
    if dims.pp > 1:
        from torchpar.parallel.pipeline import layers_per_stage, stages_per_rank

        v = stages_per_rank(par)
        split = tuple(layers_per_stage(cfg, dims, args))
    zero = par.zero_stage if (par.zero_stage in (0, 3) or dims.dp_shard > 1) else 0
    return Layout(dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp, zero, tr.local_batch_size, accum,
                  par.pipeline_parallel_microbatch_size, par.pipeline_parallel_schedule, v,
                  tr.activation_checkpoint, par.sequence_parallel and dims.tp > 1,
                  par.loss_parallel and dims.tp > 1, 2 if tr.mixed_precision_param == "bfloat16" else 4, split,
                  par.cpu_offload), args


def _split(args, lay: Layout) -> list[int]:
    if lay.pp == 1:
        return [args.n_layers]
    if lay.layers_per_stage:
        return list(lay.layers_per_stage)
    from torchpar.parallel.pipeline import balanced_split

    return balanced_split(args, lay.pp * lay.stages_per_rank)


def _stage_ids(lay: Layout, pp_rank: int) -> list[int]:
    from torchpar.parallel.pipeline import stage_ids_of_rank

    return stage_ids_of_rank(pp_rank, lay.pp, lay.stages_per_rank, lay.schedule) if lay.pp > 1 else [0]


def state_bytes(args, lay: Layout, coords: dict[str, int]) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of the rank at ``coords`` (pp, dp_shard,
    tp), as torchpar lays them out: exact, including uneven shards and ZeRO 1-2 padding."""
    split = _split(args, lay)
    n_stages = len(split)
    params = []
    for s in _stage_ids(lay, coords.get("pp", 0)):
        params += stage_params(args, s == 0, s == n_stages - 1, split[s])
    tp_i, dp_i = coords.get("tp", 0), coords.get("dp_shard", 0)

    def tp_local(shape, tp_dim):
        rows, cols = shape
        if lay.tp > 1 and tp_dim == 0:
            rows = chunk(rows, lay.tp, tp_i)
        elif lay.tp > 1 and tp_dim == 1:
            cols = chunk(cols, lay.tp, tp_i)
        return rows, cols

    if lay.zero_stage == 3:  # FSDP2: dim 0 of each (TP-local) parameter split over dp_shard
        n = sum(chunk(r, lay.dp_shard, dp_i) * c for r, c in (tp_local(shape, t) for _, shape, t in params))
        return {"param_bytes": 4 * n, "grad_bytes": 4 * n, "optim_bytes": 8 * n}
    total = sum(r * c for r, c in (tp_local(shape, t) for _, shape, t in params))
    shards = lay.dp_shard if lay.zero_stage in (1, 2) else 1
    shard = math.ceil(total / shards)
    grads = shard if lay.zero_stage == 2 and shards > 1 else shard * shards
    return {"param_bytes": 4 * total, "grad_bytes": 4 * grads, "optim_bytes": 8 * shard}


def rank_coords(lay: Layout, rank: int) -> dict[str, int]:
    """Mesh coordinates of a global rank: dims (pp, dp_replicate, dp_shard, tp), tp fastest."""
    out = {}
    for name, size in reversed((("pp", lay.pp), ("dp_replicate", lay.dp_replicate), ("dp_shard", lay.dp_shard),
                                ("tp", lay.tp))):
        out[name] = rank % size
        rank //= size
    return out


def deepspeed_bytes(n_params: int, zero_stage: int, dp: int) -> dict[str, float]:
    """Mixed-precision bytes per rank in DeepSpeed's / Megatron's convention (see module doc)."""
    return {"param_bytes": 2 * n_params / (dp if zero_stage >= 3 else 1),
            "grad_bytes": 2 * n_params / (dp if zero_stage >= 2 else 1),
            "optim_bytes": 12 * n_params / (dp if zero_stage >= 1 else 1)}


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
    params = [p for s in stages for p in stage_params(args, s == 0, s == len(split) - 1, split[s])]
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
        local = []  # (rows, cols) of the rank's TP-local parameters
        for _, (rows, cols), tp_dim in params:
            if t > 1 and tp_dim == 0:
                rows = chunk(rows, t, 0)
            elif t > 1 and tp_dim == 1:
                cols = chunk(cols, t, 0)
            local.append((rows, cols))
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
            micro = lay.accum if lay.pp == 1 else 1
            block_gathers = 2 * micro if lay.pp == 1 else 1  # forward, and again for backward
            for unit in blocks:
                add("dp_shard", "all_gather", unit_bytes(unit, act), n, block_gathers)
                add("dp_shard", "reduce_scatter", unit_bytes(unit, 4), n)
            if root:
                add("dp_shard", "all_gather", unit_bytes(root, act), n, micro)
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


# ------------------------------------------------------------------ checks against measurement


def saved_activation_bytes(fn, *inputs, exclude=()) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn(*inputs)`` runs — the
    activation memory held at the peak, just before backward. Storages in ``exclude``
    (parameters, buffers) and inputs are not counted; a storage saved twice counts once."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in (*exclude, *inputs)}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(seen.values())


def activation_check(flavor: str = "debug", batch: int = 8, seq: int = 128) -> dict:
    """The real model in fp32 on the CPU, one microbatch: bytes saved for backward by one block
    and by the whole forward + loss, against this planner's predictions (Korthikanti et al. per
    layer; activations + logits for the model)."""
    import torch

    from torchpar.loss import cross_entropy_sum
    from torchpar.models import Transformer

    args = model_args(flavor)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    cos, sin = model.rope_cos, model.rope_sin
    params = [*model.parameters(), cos, sin]
    h = torch.randn(batch, seq, args.dim, requires_grad=True)
    layer = saved_activation_bytes(lambda x: model.layers["0"](x, cos, sin), h, exclude=params)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1))
    whole = saved_activation_bytes(lambda x: cross_entropy_sum(model(x[:, :-1]), x[:, 1:]), tokens, exclude=params)
    lay = Layout(local_batch_size=batch)
    predicted = plan(args, lay, PRESETS["H100-80GB"], seq).memory
    per_layer = layer_activation_bytes(args, seq, batch, lay, 4)
    return {"flavor": flavor, "batch": batch, "seq": seq, "measured_layer_bytes": layer,
            "predicted_layer_bytes": per_layer, "ratio": layer / per_layer, "measured_model_bytes": whole,
            "predicted_model_bytes": predicted["activation_bytes"] + predicted["logits_bytes"],
            "model_ratio": whole / (predicted["activation_bytes"] + predicted["logits_bytes"])}


def predict_for_trainer(cfg: JobConfig, world: int, actions: dict | None = None) -> dict:
    """What the trainer logs at its first step: each rank's predicted state bytes, the predicted
    device peak (state + activations + transients) of the heaviest rank. ``actions``: the
    running pipeline's schedule (no extra process group is made inside a running job)."""
    lay, args = layout_from_config(cfg, world)
    per_rank = [state_bytes(args, lay, rank_coords(lay, r)) for r in range(world)]
    peak = plan(args, lay, PRESETS["H100-80GB"], cfg.training.seq_len, actions=actions).memory["total_bytes"]
    return {"per_rank": per_rank, "peak_bytes": peak}


# ------------------------------------------------------------------ the seeds' worked examples


def seed_examples() -> list[dict]:
    """Each worked example of the tutorials in shared/seeds, recomputed. Every item: what the
    tutorial says, the exact figures, and a note where it rounds or slips."""
    from torchpar.parallel.dims import ParallelDims

    GB, MB = 1e9, 1e6
    out = []
    # 1. BERT-Large-sized data parallelism on 8 x A100-80GB.
    n, gpus, a100 = 340e6, 8, PRESETS["A100-80GB"]
    grad = 2 * n
    ring = 2 * (gpus - 1) / gpus * grad  # bytes each GPU sends in a ring all-reduce
    tokens = 256 * 512 // gpus  # global batch 256 sequences of 512 tokens
    compute = 6 * n * tokens / (a100.peak_flops * 0.5)
    out.append({
        "example": "BERT-Large (340M) data parallel on 8 x A100-80GB",
        "seed": "fp16 params 680 MB, grads 680 MB, Adam states 2.7 GB, ~4 GB total; all-reduce 680 MB x 8 = "
                "5.44 GB, ~9 ms over NVLink 600 GB/s; compute ~200 ms",
        "exact": {"fp16_params_MB": 2 * n / MB, "fp16_grads_MB": grad / MB, "adam_moments_GB": 8 * n / GB,
                  "fp32_master_GB": 4 * n / GB, "total_mixed_precision_GB": 16 * n / GB,
                  "allreduce_sent_per_gpu_MB": ring / MB, "allreduce_ms": 1e3 * ring / a100.intra_bw,
                  "compute_ms_seq512_50pct": 1e3 * compute,
                  "comm_share": ring / a100.intra_bw / (compute + ring / a100.intra_bw)},
        "note": f"The ~4 GB leaves out the fp32 master copy ({4 * n / GB:.2f} GB): mixed-precision Adam holds 16 "
                f"bytes per parameter, {16 * n / GB:.2f} GB. A ring all-reduce sends 2(N-1)/N x {grad / MB:.0f} MB = "
                f"{ring / GB:.2f} GB per GPU, not {grad / MB:.0f} MB x 8; at {a100.intra_bw / GB:.0f} GB/s per direction "
                f"(NVLink's 600 GB/s counts both) that is {1e3 * ring / a100.intra_bw:.2f} ms, "
                f"{100 * ring / a100.intra_bw / compute:.1f}% of the {1e3 * compute:.0f} ms of compute.",
    })
    # 2. GPT-3 175B: weights and Adam.
    args = model_args("gpt3-175B")
    n = num_params(args)
    out.append({
        "example": "GPT-3 175B memory",
        "seed": "fp16 weights ~350 GB; with Adam (2 extra fp32 copies) and gradients over 1.2 TB",
        "exact": {"params": n, "fp16_weights_GB": 2 * n / GB, "seed_components_TB": 12 * n / 1e12,
                  "mixed_precision_adam_TB": 16 * n / 1e12},
        "note": f"torchpar's gpt3-175B has {n / 1e9:.2f}B parameters (untied {args.vocab_size}-token embedding and "
                f"head). The seed's own parts (fp16 weights + fp16 grads + two fp32 moments = 12 bytes/param) give "
                f"{12 * n / 1e12:.2f} TB, and the fp32 master copy makes 16 bytes/param = {16 * n / 1e12:.2f} TB: "
                "'over 1.2 TB' is true but less than half of it.",
    })
    # 3. TP = 8 shard of the QKV projection.
    d = args.dim
    qkv = d * 3 * d
    out.append({
        "example": "GPT-3 175B QKV projection under TP = 8",
        "seed": "12288 x 36864 ~ 1.8 GB (fp16); each of 8 shards 12288 x 4608 ~ 226 MB",
        "exact": {"qkv_fp16_MB": 2 * qkv / MB, "qkv_fp32_MB": 4 * qkv / MB, "shard_cols": 3 * d // 8,
                  "shard_fp16_MB": 2 * qkv / 8 / MB},
        "note": f"1.8 GB and 226 MB are the fp32 sizes ({4 * qkv / MB:.0f} and {4 * qkv / 8 / MB:.0f} MB); in fp16 the "
                f"matrix is {2 * qkv / MB:.0f} MB and a shard {2 * qkv / 8 / MB:.0f} MB.",
    })
    # 4. PP = 4 with 16 microbatches.
    bubble = {s: pipeline_bubble(Layout(pp=4, local_batch_size=16, schedule=s), 16) for s in ("GPipe", "1F1B")}
    out.append({
        "example": "PP = 4, 16 microbatches (global batch 2048 -> microbatches of 128)",
        "seed": "bubble (p-1)/(p-1+m) = 3/19 ~ 15.8%",
        "exact": {"bubble_GPipe": bubble["GPipe"], "bubble_1F1B": bubble["1F1B"], "formula": 3 / 19,
                  "microbatch_size": 2048 // 16},
        "note": "Measured on torch's own schedules (the same simulation as `torchpar schedule`): exactly 3/19.",
    })
    # 5. 64 GPUs as DP 2 x TP 8 x PP 4.
    lay = Layout(pp=4, dp_shard=2, tp=8, zero_stage=0, local_batch_size=16, layers_per_stage=(24, 24, 24, 24))
    per_gpu = state_bytes(args, lay, {"pp": 1, "dp_shard": 0, "tp": 0})["param_bytes"] / 4
    first = state_bytes(args, lay, {"pp": 0, "dp_shard": 0, "tp": 0})["param_bytes"] / 4
    ds0, ds1 = deepspeed_bytes(per_gpu, 0, 2), deepspeed_bytes(per_gpu, 1, 2)
    out.append({
        "example": "175B on 64 GPUs as DP 2 x TP 8 x PP 4",
        "seed": "each GPU keeps 1/8 of the parameters (TP) of 1/4 of the layers (PP) and sees 1/2 of the data",
        "exact": {"params_per_gpu_middle_stage": per_gpu, "params_per_gpu_first_stage": first,
                  "mixed_precision_GB_no_zero": sum(ds0.values()) / GB,
                  "mixed_precision_GB_zero1": sum(ds1.values()) / GB},
        "note": f"A middle stage holds 24 layers / 8 = {per_gpu / 1e9:.2f}B parameters per GPU (the first also 1/8 "
                f"of the embedding). With Adam that is {sum(ds0.values()) / GB:.0f} GB without ZeRO — more than an "
                f"80 GB GPU — and {sum(ds1.values()) / GB:.0f} GB with ZeRO-1 over the 2 data-parallel replicas, "
                "before activations.",
    })
    # 6. DeepSpeed's batch arithmetic.
    dims = ParallelDims(1, 1, 4, 1, 2, 4)
    out.append({
        "example": "DeepSpeed batch arithmetic",
        "seed": "micro-batch 4 x accumulation 2 x 4 GPUs = 32",
        "exact": {"accumulation": dims.grad_accum_steps(4, 32), "global_batch": 4 * dims.grad_accum_steps(4, 32) * 4},
        "note": "torchpar: training.local_batch_size = 4, training.global_batch_size = 32 on 4 ranks gives 2 "
                "accumulation steps (checked: other values are refused with the formula).",
    })
    return out


# ------------------------------------------------------------------ search and the command


# Pipeline schedules the search tries: (name, stages per rank).
SEARCHED_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))


def _schedule_fits(schedule: str, pp: int, v: int, n_micro: int, n_layers: int) -> bool:
    """The trainer's own pipeline rules (parallel/pipeline.py validate_pipeline), for the search."""
    if pp * v > n_layers or n_micro < pp:
        return False
    if schedule == "Interleaved1F1B":
        return n_micro % max(1, n_micro // pp) == 0
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(args, cluster: Cluster, global_batch: int, seq: int, param_dtype_bytes: int = 2,
           efficiency: float = 0.5) -> list[Plan]:
    """Every layout that divides the world and the model, ranked by estimated tokens/s."""
    from torchpar.parallel.pipeline import balanced_split

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
                            if not _schedule_fits(schedule, pp, v, n_micro, args.n_layers):
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
    ap = argparse.ArgumentParser(prog="torchpar plan", description=__doc__.split("\n\n")[0])
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
