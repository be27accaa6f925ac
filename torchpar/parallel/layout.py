"""Layout: the one resolved description of how a job is spread over its ranks, and its mesh.

Built once from the config by :func:`resolve_layout` (every check that needs no process group),
then read by the trainer, the parallelize path and the planner alike. The planner also builds
layouts directly, by keyword, to search them.

Mesh order, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp``. The innermost
dimension gets adjacent ranks, which torchrun places on the same node: TP all-reduces run on
every layer, so they get the fastest links; context parallelism's attention exchanges (every
layer, activations) next; ZeRO-3 all-gathers (dp_shard) after them; the replicas' all-reduce
(once per step) and the pipeline's point-to-point sends are the lightest and may cross nodes.

The ranks of a ``cp`` group see the same sequences, each a part of them, so their gradients are
summed like those of data-parallel ranks: ZeRO shards over ``dp_shard x cp`` (the flattened
``dp_shard_cp``) and gradients are averaged over ``dp x cp`` (``dp_cp``).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from torchpar.composition import Features, check
from torchpar.config import Parallelism
from torchpar.console import warn
from torchpar.device import device_type, float8_matmuls, group_timeout
from torchpar.errors import ConfigError
from torchpar.models.lora import adapted_layers, first_adapted_block, is_adapter, with_adapters
from torchpar.models.lora import spec as lora_spec
from torchpar.optim import kind_of
from torchpar.parallel.flat import MAX_BUCKETS, bucket_elements, flat_shards
from torchpar.parallel.float8 import check_float8
from torchpar.parallel.pipeline import SPLIT_BACKWARD, balanced_split, pipeline_split, stage_ids
from torchpar.parallel.recompute import recomputed

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DEGREE_FIELDS = {"dp_replicate": "data_parallel_replicate_degree", "dp_shard": "data_parallel_shard_degree",
                 "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree",
                 "cp": "context_parallel_degree"}  # [parallelism]'s order


def effective_zero_stage(zero_stage: int, shard_ranks: int) -> int:
    """ZeRO-1/2 shard over dp_shard x cp; over one rank they shard nothing and run as stage 0
    (gradients all-reduced over the replicas). The one place this rule lives."""
    return 0 if zero_stage in (1, 2) and shard_ranks == 1 else zero_stage


# The meshes this process built, by (device type, degrees, ep): a trainer with the degrees of an
# earlier one (auto's trials, the self-test's layouts) takes its mesh, and so its process groups,
# instead of building new ones beside them (each group holds a communicator: threads and connections
# on gloo, buffers on NCCL). Torch's DTensor caches key on equal meshes, so an equal mesh with groups
# of its own would be served the first one's anyway. Each entry: (the default group it was built in,
# the mesh, the experts' view, the flattened views, the groups it made).
_MESHES: dict[tuple, tuple] = {}
# Keys whose groups release_meshes destroyed, with the default group they were built in:
# DTensor's sharding caches (Python and C++) may still hand out specs naming those meshes, so an
# equal mesh built later in that process group would be served dead groups.
_RELEASED: dict[tuple, object] = {}


def release_meshes(keep: Layout | None) -> int:
    """Destroy the process groups of every mesh this process built except ``keep``'s (the layout
    auto chose after its trials: the others' NCCL communicators would hold their buffers for the
    whole run). Every rank calls it at the same point, with no trainer of a released mesh alive.
    Returns how many groups went."""
    kept = keep.mesh_key(device_type()) if keep is not None else None
    gone = 0
    for key in [k for k in _MESHES if k != kept]:
        world, *_, groups = _MESHES.pop(key)
        if world is not dist.GroupMember.WORLD:
            continue  # (its default group is gone, and its groups with it)
        _RELEASED[key] = world
        for group in groups:  # (in creation order, the same on every rank)
            dist.destroy_process_group(group)
            gone += 1
    return gone


@dataclass(kw_only=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: each MoE block's experts split over ep of the dp_shard ranks
    cp_method: str = "alltoall"  # context parallelism's attention: alltoall | ring
    zero_stage: int = 0  # effective: see effective_zero_stage
    sequence_parallel: bool = False  # only ever true with tp > 1
    loss_parallel: bool = False  # only ever true with tp > 1
    cpu_offload: bool = False  # ZeRO-3: sharded parameters, gradients and Adam live on the CPU
    reduce_every_microstep: bool = True  # ZeRO-3 accumulation: reduce-scatter each micro-step
    local_batch_size: int = 1  # sequences per dp rank per micro-step
    accum: int = 1  # gradient-accumulation micro-steps (with a pipeline: more microbatches)
    schedule: str = "1F1B"  # pipeline schedule
    stages_per_rank: int = 1
    layers_per_stage: tuple[int, ...] = ()  # the pipeline split, stage by stage; () without one
    microbatch_size: int = 1  # pipeline microbatch
    activation_checkpoint: str = "none"  # none | full | selective
    activation_checkpoint_every: int = 1  # with full: recompute every k-th block
    param_dtype: str = "float32"  # compute copy of the weights
    reduce_dtype: str = "float32"  # gradient reduction over dp
    compile: bool = False
    bucket_mb: float = 25.0  # ZeRO 0-2: gradient bucket size
    whole_params: bool = False  # ZeRO 0-2: the optimizer needs some parameters whole (owned by one rank)
    float8: str = "off"  # FP8 matmuls of the [quantize] layers: off | tensorwise | rowwise
    float8_all_gather: bool = False  # ZeRO-3 all-gathers those layers' weights in FP8 (tensorwise)
    optimizer: object = field(default=None, compare=False, repr=False)  # [optimizer]; None: AdamW
    quantize: object = field(default=None, compare=False, repr=False)  # [quantize]; None: off
    lora_rank: int = 0  # LoRA's rank: adapters trained, the rest frozen; 0 = every parameter trained
    lora: object = field(default=None, compare=False, repr=False)  # [lora]; None: off
    # replica groups (fault tolerance): jobs of this layout averaging their gradients every step, or
    # (LocalSGD, DiLoCo) their weights or moves every replica_sync_every steps (0: every step, gradients)
    replica_groups: int = 1
    replica_sync_every: int = 0
    replica_fragments: int = 1  # (streaming DiLoCo: one of these fragments every sync_every / fragments)
    # The data carries loss masks (data.format = 'chat'): each step all-reduces its targets' count.
    loss_mask: bool = False
    z_loss: bool = False  # loss.z_loss > 0: each step's figures carry its term beside the loss
    mesh: object = field(default=None, compare=False, repr=False)  # DeviceMesh, once built
    # with ep > 1: the mesh whose dp_shard is unflattened into (efsdp, ep); see build_mesh
    experts_view: object = field(default=None, compare=False, repr=False)
    # the flattened meshes by name (dp; with cp: dp_shard_cp, dp_cp, efsdp_cp), once built
    views: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        self.zero_stage = effective_zero_stage(self.zero_stage, self.shard_ranks)
        self.sequence_parallel = self.sequence_parallel and self.tp > 1
        self.loss_parallel = self.loss_parallel and self.tp > 1
        self.float8_all_gather = (self.float8_all_gather and self.float8 == "tensorwise"
                                  and self.zero_stage == 3)
        self.layers_per_stage = tuple(self.layers_per_stage)

    def to_dict(self) -> dict:
        """The layout's fields without its mesh (for JSON and comparisons)."""
        skip = ("mesh", "experts_view", "views", "optimizer", "quantize", "lora")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    # -- sizes

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO shards over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients are averaged: dp x cp."""
        return self.dp * self.cp

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks ZeRO shards an expert over: the shard ranks holding the same experts."""
        return self.shard_ranks // self.ep

    @property
    def shard_dim(self) -> str:
        """The mesh dimension (maybe flattened) of :attr:`shard_ranks`."""
        return "dp_shard_cp" if self.cp > 1 else "dp_shard"

    @property
    def reduce_dim(self) -> str:
        """The mesh dimension (maybe flattened) of :attr:`grad_ranks`."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def degrees(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def n_microbatches(self) -> int:
        return self.local_batch_size * self.accum // self.microbatch_size

    @property
    def micro_steps(self) -> tuple[int, int]:
        """(sequences per forward, forwards per step): pipeline microbatches, or accumulation steps."""
        if self.pp > 1:
            return self.microbatch_size, self.n_microbatches
        return self.local_batch_size, self.accum

    @property
    def param_dtype_bytes(self) -> int:
        return 2 if self.param_dtype == "bfloat16" else 4

    @property
    def reduce_dtype_bytes(self) -> int:
        return 2 if self.reduce_dtype == "bfloat16" else 4

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The global pipeline stages rank ``pp_rank`` holds, in order (see pipeline.stage_ids)."""
        return stage_ids(self.pp, pp_rank, self.schedule, self.stages_per_rank)

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank, tp fastest; ``ep`` and ``efsdp`` split dp_shard (ep
        fastest)."""
        out = {}
        for name, size in reversed(list(zip(MESH_DIMS, self.degrees))):
            out[name] = rank % size
            rank //= size
        out["ep"], out["efsdp"] = out["dp_shard"] % self.ep, out["dp_shard"] // self.ep
        return out

    def shard_index(self, coords: dict[str, int]) -> int:
        """The index among the :attr:`shard_ranks` of the rank at ``coords`` (the flattened
        dp_shard x cp, cp fastest)."""
        return coords.get("dp_shard", 0) * self.cp + coords.get("cp", 0)

    def expert_shard_index(self, coords: dict[str, int]) -> int:
        """The index among the :attr:`expert_shard_ranks` of the rank at ``coords`` (efsdp x cp)."""
        return coords.get("dp_shard", 0) // self.ep * self.cp + coords.get("cp", 0)

    # -- the mesh (trainer only)

    def mesh_key(self, device_type: str) -> tuple:
        """What two layouts with the same mesh share: the device type, the degrees and ep."""
        return (device_type, self.degrees, self.ep)

    def build_mesh(self, device_type: str):
        """The one DeviceMesh, plus the flattened views: ``dp`` (replicate x shard) and, with
        context parallelism, ``dp_shard_cp`` and ``dp_cp``; with expert parallelism, the view
        :attr:`experts_view` whose ``dp_shard`` is unflattened into ``efsdp x ep``. A dimension of
        size 1 gets a group too: torch's init_device_mesh skips one only through its "fake"
        backend, which only torchcomms and torch's own tests register; a one-rank NCCL communicator
        has no peer to connect to (NCCL connects on first use), so it holds no transport buffers."""
        from torch.distributed.device_mesh import init_device_mesh

        key = self.mesh_key(device_type)
        if any(entry[0] is not dist.GroupMember.WORLD for entry in _MESHES.values()):
            _MESHES.clear()  # (the default group they were built in is gone, and their groups with it)
        if _RELEASED.get(key) is dist.GroupMember.WORLD:
            raise RuntimeError(f"the mesh {key} was released in this process (release_meshes); "
                               "DTensor's caches may still name its groups: build no equal mesh after it")
        if key in _MESHES:
            _, self.mesh, self.experts_view, self.views, _ = _MESHES[key]
            return self.mesh
        before = set(dist.distributed_c10d._world.pg_map)
        mesh = init_device_mesh(device_type, self.degrees, mesh_dim_names=MESH_DIMS)
        # The flattened meshes are kept here, by name: torch deprecates slicing them from the root.
        self.views = {"dp": mesh["dp_replicate", "dp_shard"]._flatten("dp")}
        if self.cp > 1:
            self.views["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            self.views["dp_cp"] = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self.mesh = mesh
        self.experts_view = None
        if self.ep > 1:
            view = mesh._unflatten("dp_shard", (self.dp_shard // self.ep, self.ep), ("efsdp", "ep"))
            if self.cp > 1:
                self.views["efsdp_cp"] = view["efsdp", "cp"]._flatten("efsdp_cp")
            self.experts_view = view
        made = [g for g in dist.distributed_c10d._world.pg_map if g not in before]  # (in creation order)
        for group in (g for g in made if dist.get_backend(g) != "fake"):  # (the planner's tests)
            # c10d gives a group made after the default one its own default (10 minutes on NCCL),
            # not comm.timeout_s; init_device_mesh takes a timeout only with per-dimension backend
            # options, which would also make a group of the default one's size anew.
            dist.distributed_c10d._set_pg_timeout(group_timeout(), group)
        _MESHES[key] = (dist.GroupMember.WORLD, mesh, self.experts_view, self.views, made)
        return mesh

    def submesh(self, name: str | tuple[str, ...], view=None):
        """The mesh of one dimension (or of several, a tuple), or of a flattened view (``dp``,
        ``dp_shard_cp``, ...); of ``view`` (the experts' view) instead of the root mesh if given.
        One object per name, kept with the mesh: torch makes a new one at every slicing, equal to
        the last, and DTensor's caches compare meshes by value, so a cached result of an earlier
        job on an equal mesh would carry another object than this job's DTensors — which a
        compiled block then cannot trace (its backward finds a mesh it was never given)."""
        key = name if view is None else ("view", name)
        if key not in self.views:
            self.views[key] = (view if view is not None else self.mesh)[name]
        return self.views[key]

    def coordinate(self, name: str) -> int:
        """This rank's index along a mesh dimension (or the flattened ``dp``)."""
        return self.submesh(name).get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")

    @property
    def expert_mesh(self):
        """What an expert's weights are split over: (ep, tp), ep, tp (the hidden width), or None."""
        if self.ep > 1:
            return self.submesh(("ep", "tp") if self.tp > 1 else "ep", self.experts_view)
        return self.submesh("tp") if self.tp > 1 else None

    @property
    def expert_dp_mesh(self):
        """What ZeRO-3 shards experts over: the ranks holding the same experts, efsdp (x cp), with
        dp_replicate for HSDP; the dp mesh without expert parallelism."""
        if self.ep == 1:
            return self.dp_mesh
        # (efsdp x cp is flattened from the view, but torch registers it on the root mesh)
        shard, view = ("efsdp_cp", None) if self.cp > 1 else ("efsdp", self.experts_view)
        if self.dp_replicate > 1:
            return self.submesh(("dp_replicate", shard), view)
        return self.views[shard] if shard in self.views else self.submesh(shard, view)

    @property
    def dp_mesh(self):
        """What ZeRO-3 shards over: dp_shard (x cp), or (dp_replicate, dp_shard (x cp)) for HSDP."""
        if self.dp_replicate > 1:
            return self.submesh(("dp_replicate", self.shard_dim))
        return self.submesh(self.shard_dim)


# ---------------------------------------------------------------------- from the config


def resolve_degrees(par, world: int) -> dict[str, int]:
    """``par`` is the [parallelism] section: its degrees with ``-1`` resolved, checked against
    the world size."""
    degrees = {dim: getattr(par, key) for dim, key in DEGREE_FIELDS.items()}
    auto = [dim for dim, v in degrees.items() if v == -1]
    if len(auto) > 1:
        names = [DEGREE_FIELDS[d] for d in auto]
        raise ConfigError(f"parallelism: only one degree may be -1 (the ranks left over); got -1 for {names}")
    for dim, v in degrees.items():
        if v == 0 or v < -1:
            raise ConfigError(f"parallelism.{DEGREE_FIELDS[dim]} = {v}: degrees are positive integers, or -1 "
                              "for the ranks left over")
    known = 1
    for v in degrees.values():
        known *= v if v != -1 else 1
    if auto:
        if world % known:
            others = " x ".join(f"{DEGREE_FIELDS[d]}={v}" for d, v in degrees.items() if v not in (-1, 1))
            raise ConfigError(
                f"parallelism: the other degrees ({others}) multiply to {known}, which does not divide the "
                f"world size {world}, so parallelism.{DEGREE_FIELDS[auto[0]]} = -1 cannot be resolved"
            )
        degrees[auto[0]] = world // known
    elif known != world:
        shown = " x ".join(f"{DEGREE_FIELDS[d]}={v}" for d, v in degrees.items() if d != "cp" or v > 1)
        raise ConfigError(
            f"parallelism: {shown} = {known} ranks, but the world size is {world}; make the product equal "
            "the number of processes (NGPU), or set one degree to -1"
        )
    return degrees


def grad_accum_steps(local_batch_size: int, global_batch_size: int, dp: int) -> int:
    per_step = local_batch_size * dp
    if global_batch_size == 0:
        return 1
    if global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size = {global_batch_size} must be local_batch_size ({local_batch_size}) "
            f"x dp degree ({dp}) x gradient-accumulation steps; it is not a multiple of {per_step}"
        )
    return global_batch_size // per_step


def _check_model(model, args, lay: Layout, par, tr, device: str) -> None:
    tp = lay.tp
    problem = context_problem(args, tr.seq_len, lay.cp, tp, par.sequence_parallel,
                              par.context_parallel_method, device)
    if problem:
        raise ConfigError(problem)
    if tp > 1:
        for what, n in model.tp_divisors(args).items():
            if n % tp:
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree = {tp} does not divide the model's {what} ({n}); "
                    "choose a degree that divides it"
                )
        if par.sequence_parallel and tr.seq_len % tp:
            raise ConfigError(
                f"sequence parallelism splits training.seq_len = {tr.seq_len} over tp = {tp}: make it a "
                "multiple, or set parallelism.sequence_parallel = false"
            )
    if tr.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {tr.seq_len} exceeds the model's max_seq_len {args.max_seq_len}"
        )


def context_problem(args, seq: int, cp: int, tp: int, sequence_parallel: bool, method: str,
                    device: str) -> str | None:
    """Why context parallelism of degree ``cp`` by ``method`` cannot split this model's heads or
    sequences of ``seq`` tokens (None: it can) — the trainer's check and the planner's search alike.
    Each sequence is cut into 2 x cp chunks (head-tail); all-to-all attention splits every TP rank's
    heads, KV heads included, over cp. (What it cannot run beside is in torchpar.composition.)"""
    if cp == 1:
        return None
    chunks = 2 * cp * (tp if sequence_parallel else 1)
    if seq % chunks:
        sp = f" x tp {tp} (sequence parallelism)" if tp > 1 and sequence_parallel else ""
        return (f"parallelism.context_parallel_degree = {cp} cuts training.seq_len = {seq} into 2 x {cp} "
                f"chunks{sp}: make seq_len a multiple of {chunks}")
    if method == "alltoall":
        for what, n in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
            if n % (cp * tp):
                return (f"parallelism.context_parallel_method = 'alltoall' splits the model's {what} ({n}) "
                        f"over context_parallel_degree {cp} x tensor_parallel_degree {tp}; choose degrees "
                        "whose product divides it, or context_parallel_method = 'ring'")
    elif device == "cuda" and seq % (64 * cp):
        # torch's ring merges each block's log-sum-exp by halves of the local sequence; CUDA's
        # memory-efficient kernel pads its log-sum-exp to a multiple of 32 tokens.
        return (f"parallelism.context_parallel_method = 'ring' on GPUs needs training.seq_len = {seq} to "
                f"be a multiple of 64 x context_parallel_degree = {64 * cp} (each rank's half-chunks a "
                "multiple of 32 tokens, as CUDA's attention kernel pads them); change seq_len, or use "
                "'alltoall'")
    return None


def _check_buckets_field(par, zero: int, overridden: frozenset) -> None:
    """``bucket_mb`` is a positive size, and means something only under ZeRO 0-2: an override of it
    (a key in ``overridden``) under ZeRO-3 is named."""
    if not par.bucket_mb > 0:
        raise ConfigError(f"parallelism.bucket_mb = {par.bucket_mb}: the gradient bucket size must be "
                          "positive (25 = DDP's default)")
    if zero == 3 and "parallelism.bucket_mb" in overridden and par.bucket_mb != Parallelism.bucket_mb:
        warn(f"parallelism.bucket_mb = {par.bucket_mb:g} has no effect under zero_stage 3 (FSDP2 reduces "
             "each block's gradients in one collective); drop it, or choose zero_stage 0-2 for buckets")


def layout_features(lay: Layout, model, args, document_masking: bool = False, device: str = "cpu",
                    evaluation: bool = False, chat: bool = False) -> Features:
    """The facts the composition table (torchpar.composition) reads of a layout of adapter
    ``model`` with ``args``, beside the job's other features."""
    kind = kind_of(lay.optimizer)
    schedule = lay.schedule if lay.pp > 1 else ""
    return Features(
        family=model.name, experts=model.experts(args) > 0, tied=bool(args.tie_embeddings),
        mtp=model.prediction_depths(args) > 0,
        sequence_terms=model.sequence_terms(args), custom_attention=model.custom_attention(args),
        optimizer=lay.optimizer.name if lay.optimizer is not None else "adamw",
        whole=kind.whole is not None, gathers=kind.gathers_shards, plain=kind.plain_tensors,
        compact_state=kind.compact_state, state_dtype=getattr(lay.optimizer, "state_dtype", "float32"),
        zero=lay.zero_stage,
        replicas=lay.dp_replicate, tp=lay.tp, pp=lay.pp, schedule=schedule,
        split_backward=schedule in SPLIT_BACKWARD, cp=lay.cp, cp_method=lay.cp_method, ep=lay.ep,
        recompute=lay.activation_checkpoint, compile=lay.compile, document_masking=document_masking,
        chat=chat,
        bf16=lay.param_dtype == "bfloat16", float8=lay.float8, offload=lay.cpu_offload, z_loss=lay.z_loss,
        accumulation=lay.pp == 1 and lay.accum > 1, evaluation=evaluation, lora=lay.lora_rank > 0,
        device=device)


def job_fields(optimizer=None, quantize=None, loss_mask: bool = False, lora=None,
               replicas: tuple[int, int, int] = (1, 0, 1), z_loss: bool = False) -> dict:
    """The Layout fields the job's [optimizer], [quantize] and [lora] sections give (None: AdamW, no
    FP8, no adapters), whether its data carries loss masks, how many replica groups run it, and
    whether its loss has a z-loss term."""
    rank = lora.rank if lora is not None else 0
    return dict(replica_groups=replicas[0], replica_sync_every=replicas[1], replica_fragments=replicas[2],
                optimizer=optimizer, whole_params=kind_of(optimizer).whole is not None, quantize=quantize,
                loss_mask=loss_mask, z_loss=z_loss, lora_rank=rank, lora=lora if rank else None,
                float8=quantize.float8 if quantize is not None else "off",
                float8_all_gather=quantize is not None and quantize.float8_all_gather)


def layout_of(par, tr, world: int, param_dtype: str, optimizer=None, quantize=None,
              loss_mask: bool = False, lora=None, replicas: tuple[int, int, int] = (1, 0, 1),
              z_loss: bool = False) -> Layout:
    """The layout ``par`` ([parallelism]) and ``tr`` ([training]) give on ``world`` ranks before any
    check of the model or of what composes (degrees resolved, accumulation counted): what the
    composition table reads (:func:`layout_features`), then :func:`resolve_layout` checks."""
    degrees = resolve_degrees(par, world)
    accum = grad_accum_steps(
        tr.local_batch_size, tr.global_batch_size, degrees["dp_replicate"] * degrees["dp_shard"]
    )
    return Layout(**degrees, ep=par.expert_parallel_degree, cp_method=par.context_parallel_method,
                  zero_stage=par.zero_stage, sequence_parallel=par.sequence_parallel,
                  loss_parallel=par.loss_parallel, cpu_offload=par.cpu_offload,
                  reduce_every_microstep=par.zero3_reduce_every_microstep,
                  local_batch_size=tr.local_batch_size, accum=accum, schedule=par.pipeline_parallel_schedule,
                  microbatch_size=par.pipeline_parallel_microbatch_size,
                  activation_checkpoint=tr.activation_checkpoint,
                  activation_checkpoint_every=tr.activation_checkpoint_every, param_dtype=param_dtype,
                  reduce_dtype=tr.mixed_precision_reduce, compile=tr.compile,
                  bucket_mb=par.bucket_mb,
                  **job_fields(optimizer, quantize, loss_mask, lora, replicas, z_loss))


def resolve_layout(par, tr, model, args, world: int, param_dtype: str, optimizer=None,
                   document_masking: bool = False, device: str | None = None,
                   overridden: frozenset = frozenset(), quantize=None, loss_mask: bool = False,
                   lora=None, replicas: tuple[int, int, int] = (1, 0, 1), z_loss: bool = False) -> Layout:
    """The layout ``par`` ([parallelism]) and ``tr`` ([training]) give a model (its adapter and
    args) on ``world`` ranks, after every check that needs no process group. ``param_dtype``: the
    compute dtype, ``training.mixed_precision_param`` resolved for the device; ``optimizer``: the
    [optimizer] section (None: AdamW's needs); ``document_masking``: data.document_masking;
    ``device``: the device type the job runs on (default: this machine's); ``overridden``: the keys
    the command line set (JobConfig.overridden); ``quantize``: the [quantize] section (None: off);
    ``loss_mask``: the data carries loss masks (conversations); ``lora``: the [lora] section (None: off);
    ``replicas``: (replica groups training together, steps between their syncs; 0 = every step's
    gradients) under fault tolerance; ``z_loss``: loss.z_loss > 0."""
    device = device or device_type()
    if par.expert_parallel_degree < 1:
        raise ConfigError(f"parallelism.expert_parallel_degree = {par.expert_parallel_degree}: a degree is a "
                          "positive integer (1 = no expert parallelism)")
    layout = layout_of(par, tr, world, param_dtype, optimizer, quantize, loss_mask, lora, replicas, z_loss)
    if layout.zero_stage != par.zero_stage:
        warn(f"parallelism.zero_stage = {par.zero_stage} with data_parallel_shard_degree 1 shards nothing; "
             "it runs as zero_stage 0 (gradients all-reduced over the replicas)")
    check(layout_features(layout, model, args, document_masking, device))  # what cannot run together
    _check_model(model, args, layout, par, tr, device)
    _check_buckets_field(par, layout.zero_stage, overridden)
    _check_experts(model, args, layout)
    if layout.pp > 1:
        layout.schedule, layout.stages_per_rank, layout.layers_per_stage = pipeline_split(par, layout, model,
                                                                                          args)
    _check_recompute(layout, args)
    if layout.zero_stage < 3:
        _check_buckets(layout, model, args)
    if layout.lora_rank:
        _check_lora(model, args, layout, device)
    if layout.float8 != "off":
        why = float8_matmuls() if device == "cuda" else None  # (this machine's GPU, where it has one)
        if why:
            raise ConfigError(f"quantize.float8 = {layout.float8!r}: {why}; set quantize.float8 = 'off'")
        if not check_float8(model, args, quantize, layout.tp):
            warn(f"quantize.float8 = {layout.float8!r} converts no layer: none of {list(quantize.modules)} "
                 "is a linear layer large enough to gain (quantize.skip_small) outside quantize.exclude")
    return layout


def _check_lora(model, args, layout: Layout, device: str) -> None:
    """LoRA's patterns must name linear layers, and its rank stay below their widths; its dropout
    under TP needs one mask on every tp rank for the input they share (a replicated DTensor), which
    torch's DTensor random ops draw on CUDA devices only (elsewhere each rank its own: the replicated
    A's copies would drift apart). A schedule that splits backward into input and weight passes
    finds a stage's weights through its input's gradient (torch 2.13): a stage past the first whose
    input carries none (no adapter before it) would train nothing."""
    lora, tp = layout.lora, layout.tp
    if lora.dropout > 0 and tp > 1 and device != "cuda":
        raise ConfigError(f"lora.dropout = {lora.dropout:g} with tensor_parallel_degree = {tp} on {device}: "
                          "the tp ranks must draw one dropout mask for the input they share, which torch's "
                          "DTensor random ops do on CUDA only; set lora.dropout = 0 or "
                          "tensor_parallel_degree = 1")
    adapted = adapted_layers(model, args, lora_spec(lora))
    if not adapted:
        stacks = " (a mixture of experts' routed experts are stacks, not linear layers: they stay frozen)"
        raise ConfigError(f"lora.modules = {list(lora.modules)} (less lora.exclude = {list(lora.exclude)}) "
                          f"names no linear layer of the blocks{stacks if model.expert_plan else ''}; name "
                          "some, e.g. 'layers.*.attention.*'")
    narrowest = min(min(shape) for shape in adapted.values())
    if lora.rank > narrowest:
        name = next(n for n, shape in adapted.items() if min(shape) == narrowest)
        raise ConfigError(f"lora.rank = {lora.rank} exceeds the {narrowest} features of {name} (an adapter "
                          f"of rank r adds nothing past min(in, out)); use lora.rank <= {narrowest}")
    first, stage0 = first_adapted_block(model, args, lora_spec(lora)), split_of(model, args, layout)[0]
    if layout.pp > 1 and layout.schedule in SPLIT_BACKWARD and first >= stage0:
        raise ConfigError(f"lora.modules adapts no layer of the first pipeline stage (layers 0-{stage0 - 1}; "
                          f"the first adapted is layers.{first}) with pipeline_parallel_schedule = "
                          f"{layout.schedule!r}, whose split backward finds a stage's weights through its "
                          "input's gradient, which none carries before the first adapter: adapt a layer of "
                          "the first stage, or use a schedule without a split backward (1F1B, "
                          "Interleaved1F1B, GPipe)")


def _check_experts(model, args, lay: Layout) -> None:
    """Expert parallelism's degree against the model's experts and the shard ranks it borrows."""
    key, ep = "parallelism.expert_parallel_degree", lay.ep
    if ep == 1:
        return
    experts = model.experts(args)
    if experts % ep:
        raise ConfigError(f"{key} = {ep} does not divide the model's {experts} experts (model.experts); "
                          "choose a degree that divides them")
    if lay.dp_shard % ep:
        raise ConfigError(f"{key} = {ep} must divide parallelism.data_parallel_shard_degree = "
                          f"{lay.dp_shard}: the experts' ranks are taken from the shard ranks; raise "
                          "the shard degree or lower the expert degree")


def _check_recompute(layout: Layout, args) -> None:
    """``activation_checkpoint_every`` picks blocks by global index: beyond the layer count it picks
    none (refused: recomputation was asked for); a pipeline stage may still get none of its own."""
    k, n = layout.activation_checkpoint_every, args.n_layers
    if layout.activation_checkpoint != "full" or k == 1:
        return
    if k > n:
        raise ConfigError(f"training.activation_checkpoint_every = {k} exceeds the model's {n} layers, so "
                          f"no block would be recomputed (it picks blocks {k - 1}, {2 * k - 1}, ...); use at "
                          f"most {n}, or training.activation_checkpoint = 'none'")
    if layout.pp > 1:
        starts = [0, *itertools.accumulate(layout.layers_per_stage)]
        bare = [s for s, (a, b) in enumerate(zip(starts, starts[1:]))
                if not any(recomputed(i, "full", k) for i in range(a, b))]
        if bare:
            warn(f"training.activation_checkpoint_every = {k} recomputes no block of pipeline stage(s) "
                 f"{', '.join(map(str, bare))} (layers per stage {list(layout.layers_per_stage)}; it picks "
                 f"blocks {k - 1}, {2 * k - 1}, ... by global index), so they keep every activation; use "
                 "at most the layers of a stage")


def chunk(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when torch.chunk / DTensor Shard split ``n`` into ``parts``."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


def split_of(model, args, lay: Layout) -> list[int]:
    """Layers per pipeline stage: the layout's split, or the balanced one."""
    if lay.pp == 1:
        return [args.n_layers]
    if lay.layers_per_stage:
        return list(lay.layers_per_stage)
    return balanced_split(model, args, lay.num_stages)


def stage_entries(model, args, split: list[int] | tuple[int, ...],
                  stage: int, lora: tuple | None = None) -> list[tuple[str, tuple[int, int], int | None]]:
    """The adapter's parameter entries (``stage_params``) of pipeline stage ``stage`` of ``split``,
    with LoRA's adapters where ``lora`` (``models.lora.spec``) puts them."""
    start = sum(split[:stage])
    layers = range(start, start + split[stage])
    entries = model.stage_params(args, stage == 0, stage == len(split) - 1, layers)
    if lora is None:
        return entries
    # (a stage's entries: its first-stage modules', each block's — the last stage's prediction depths'
    # after its own —, then its last-stage modules')
    at = len(model.stage_params(args, stage == 0, False, range(0)))
    out = entries[:at]
    for layer in [*layers, *(model.depth_blocks(args) if stage == len(split) - 1 else ())]:
        at += len(model.block_params(args, layer))
        out += block_entries(model, args, layer, lora)
    return out + entries[at:]


def block_entries(model, args, layer: int, lora: tuple | None = None) -> list:
    """Block ``layer``'s parameter entries (the adapter's ``block_params``), with LoRA's adapters
    where ``lora`` (``models.lora.spec``) puts them."""
    block = model.block_params(args, layer)
    return with_adapters(block, layer, adapted_layers(model, args, lora), lora[0]) if lora else block


def trained(name: str, lora: tuple | None) -> bool:
    """Whether the parameter entry ``name`` is trained (with LoRA, only the adapters are)."""
    return lora is None or is_adapter(name)


def rank_params(model, args, lay: Layout, pp_rank: int, tp_index: int = 0) -> list[tuple[int, int]]:
    """(rows, cols) of each parameter the rank holds at pipeline position ``pp_rank`` and TP
    coordinate ``tp_index``, after tensor parallelism, in model order (first-stage modules,
    blocks, last-stage modules)."""
    return list(params_at(model, args, rank_key(model, args, lay, pp_rank), lay.ep, lay.tp, tp_index))


def rank_key(model, args, lay: Layout, pp_rank: int) -> tuple:
    """What of a layout fixes the parameters of the rank at ``pp_rank``: (layers per stage, its
    stages, LoRA's ``spec``). The planner's search prices thousands of layouts that share a few of
    these, so what is computed from them is cached by them (:func:`params_at`, :func:`names_at`)."""
    return tuple(split_of(model, args, lay)), tuple(lay.stage_ids(pp_rank)), lora_spec(lay.lora)


@functools.lru_cache(maxsize=4096)
def params_at(model, args, key: tuple, ep: int, tp: int, tp_index: int) -> tuple[tuple[int, int], ...]:
    """:func:`rank_params` of the rank :func:`rank_key` ``key`` names, at ``ep``, ``tp``, ``tp_index``."""
    split, stages, lora = key
    experts = expert_names(model) if ep > 1 else set()
    out = []
    for s in stages:
        for name, (rows, cols), tp_dim in stage_entries(model, args, split, s, lora):
            if name in experts:
                rows //= ep
            if tp > 1 and tp_dim == 0:
                rows = chunk(rows, tp, tp_index)
            elif tp > 1 and tp_dim == 1:
                cols = chunk(cols, tp, tp_index)
            out.append((rows, cols))
    return tuple(out)


def expert_names(model) -> set[str]:
    """The adapter's entry names (block-relative) of stacked expert weights: rows are experts."""
    return {f"{module}.{weight}" for module, weights in model.expert_plan.items() for weight in weights}


def rank_param_names(model, args, lay: Layout, pp_rank: int) -> list[str]:
    """The names of :func:`rank_params`' parameters, in its order."""
    return list(names_at(model, args, rank_key(model, args, lay, pp_rank)))


@functools.lru_cache(maxsize=4096)
def names_at(model, args, key: tuple) -> tuple[str, ...]:
    """:func:`rank_param_names` of the rank that :func:`rank_key` ``key`` names."""
    split, stages, lora = key
    return tuple(name for s in stages for name, _, _ in stage_entries(model, args, split, s, lora))


def _check_buckets(layout: Layout, model, args) -> None:
    """ZeRO 0-2 cut each rank's gradients into buckets of ``bucket_mb``: a count beyond
    MAX_BUCKETS is refused by arithmetic, before anything is built."""
    n, lora = flat_shards(layout), lora_spec(layout.lora)
    # (the buffer holds the trained parameters alone)
    held = max(sum(r * c for (r, c), name in zip(rank_params(model, args, layout, p),
                                                 rank_param_names(model, args, layout, p))
                   if trained(name, lora)) for p in range(layout.pp))
    elements = math.ceil(held / n) * n
    buckets = math.ceil(elements / bucket_elements(layout))
    if buckets > MAX_BUCKETS:
        least = elements * getattr(torch, layout.reduce_dtype).itemsize / MAX_BUCKETS / 2**20
        digits = 10 ** (math.floor(math.log10(least)) - 1)  # two significant digits, rounded up
        raise ConfigError(
            f"parallelism.bucket_mb = {layout.bucket_mb:g} cuts a rank's {elements:,} gradient elements "
            f"into {buckets:,} buckets, more than {MAX_BUCKETS:,} (each is a collective and an optimizer "
            f"tensor per step); use at least {math.ceil(least / digits) * digits:.2g} (25 = DDP's default)")
