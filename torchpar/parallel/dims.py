"""ParallelDims: the one object that owns the layout and its DeviceMesh.

Mesh order, outermost to innermost: ``pp, dp_replicate, dp_shard, tp``. The innermost
dimension gets adjacent ranks, which torchrun places on the same node: TP all-reduces run on
every layer, so they get the fastest links; ZeRO-3 all-gathers (dp_shard) come next; the
replicas' all-reduce (once per step) and the pipeline's point-to-point sends are the lightest
and may cross nodes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torchpar.config import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    zero_stage: int
    world_size: int

    @classmethod
    def from_config(cls, par, world_size: int) -> "ParallelDims":
        """``par`` is the [parallelism] section. Resolves ``-1`` and checks the product."""
        degrees = {
            "data_parallel_replicate_degree": par.data_parallel_replicate_degree,
            "data_parallel_shard_degree": par.data_parallel_shard_degree,
            "tensor_parallel_degree": par.tensor_parallel_degree,
            "pipeline_parallel_degree": par.pipeline_parallel_degree,
        }
        auto = [k for k, v in degrees.items() if v == -1]
        if len(auto) > 1:
            raise ConfigError(f"parallelism: only one degree may be -1 (the ranks left over); got -1 for {auto}")
        for k, v in degrees.items():
            if v == 0 or v < -1:
                raise ConfigError(f"parallelism.{k} = {v}: degrees are positive integers, or -1 for the ranks left over")
        if auto:
            known = 1
            for k, v in degrees.items():
                if v != -1:
                    known *= v
            if world_size % known:
                raise ConfigError(
                    f"parallelism: the other degrees multiply to {known}, which does not divide the world size {world_size}, "
                    f"so parallelism.{auto[0]} = -1 cannot be resolved"
                )
            degrees[auto[0]] = world_size // known
        product = 1
        for v in degrees.values():
            product *= v
        if product != world_size:
            shown = " x ".join(f"{k}={v}" for k, v in degrees.items())
            raise ConfigError(
                f"parallelism: {shown} = {product} ranks, but the world size is {world_size}; "
                "make the product equal the number of processes (NGPU), or set one degree to -1"
            )
        dims = cls(pp=degrees["pipeline_parallel_degree"], dp_replicate=degrees["data_parallel_replicate_degree"],
                   dp_shard=degrees["data_parallel_shard_degree"], tp=degrees["tensor_parallel_degree"],
                   zero_stage=par.zero_stage, world_size=world_size)
        if par.zero_stage in (1, 2) and dims.dp_shard == 1:
            warnings.warn(
                f"zero_stage {par.zero_stage} with data_parallel_shard_degree 1 shards nothing; it runs as zero_stage 0 "
                "(gradients all-reduced over the replicas)", stacklevel=2)
        return dims

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def check_model(self, args, seq_len: int, sequence_parallel: bool) -> None:
        """Tensor-parallel divisibility, before any process group exists."""
        if self.tp == 1:
            return
        for what, n in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                        ("ffn hidden size", args.ffn_hidden), ("vocab_size", args.vocab_size)):
            if n % self.tp:
                raise ConfigError(f"parallelism.tensor_parallel_degree = {self.tp} does not divide the model's {what} ({n}); "
                                  "choose a degree that divides it")
        if sequence_parallel and seq_len % self.tp:
            raise ConfigError(f"sequence parallelism splits training.seq_len = {seq_len} over tp = {self.tp}: make it a multiple, "
                              "or set parallelism.sequence_parallel = false")

    def grad_accum_steps(self, local_batch_size: int, global_batch_size: int) -> int:
        per_step = local_batch_size * self.dp
        if global_batch_size == 0:
            return 1
        if global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size = {global_batch_size} must be local_batch_size ({local_batch_size}) x "
                f"dp degree ({self.dp}) x gradient-accumulation steps; it is not a multiple of {per_step}")
        return global_batch_size // per_step

    def build_mesh(self, device_type: str):
        """The one DeviceMesh, plus the flattened ``dp`` view (replicate x shard)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.degrees, mesh_dim_names=MESH_DIMS)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self.mesh = mesh
        return mesh

    def coordinate(self, name: str) -> int:
        """This rank's index along a mesh dimension (or the flattened ``dp``)."""
        return self.mesh[name].get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")
