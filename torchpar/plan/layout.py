"""The cluster, a layout, and exactly what each rank of it holds (parameters, gradients, Adam)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchpar.config import JobConfig
from torchpar.models import model_args


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
    par, tr = cfg.parallelism, cfg.training
    accum = validate_layout(par, tr, dims, args)
    split = ()
    v = 1
    if dims.pp > 1:
        from torchpar.parallel.pipeline import layers_per_stage, stages_per_rank

        v = stages_per_rank(par)
        split = tuple(layers_per_stage(par, dims, args))
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


def rank_params(args, lay: Layout, pp_rank: int, tp_index: int = 0) -> list[tuple[int, int]]:
    """(rows, cols) of each parameter the rank holds at pipeline position ``pp_rank`` and TP
    coordinate ``tp_index``, after tensor parallelism, in model order (embedding, blocks, head)."""
    split = _split(args, lay)
    out = []
    for s in _stage_ids(lay, pp_rank):
        for _, (rows, cols), tp_dim in stage_params(args, s == 0, s == len(split) - 1, split[s]):
            if lay.tp > 1 and tp_dim == 0:
                rows = chunk(rows, lay.tp, tp_index)
            elif lay.tp > 1 and tp_dim == 1:
                cols = chunk(cols, lay.tp, tp_index)
            out.append((rows, cols))
    return out


def state_bytes(args, lay: Layout, coords: dict[str, int]) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of the rank at ``coords`` (pp, dp_shard,
    tp), as torchpar lays them out: exact, including uneven shards and ZeRO 1-2 padding."""
    local = rank_params(args, lay, coords.get("pp", 0), coords.get("tp", 0))
    if lay.zero_stage == 3:  # FSDP2: dim 0 of each (TP-local) parameter split over dp_shard
        n = sum(chunk(r, lay.dp_shard, coords.get("dp_shard", 0)) * c for r, c in local)
        return {"param_bytes": 4 * n, "grad_bytes": 4 * n, "optim_bytes": 8 * n}
    total = sum(r * c for r, c in local)
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
