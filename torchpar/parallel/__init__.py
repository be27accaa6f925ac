"""One parallelize path for every model flavour and layout.

Order (as in torchtitan): build on the meta device -> pipeline split -> per stage: tensor
parallel -> activation checkpointing -> compile -> ZeRO-3 (FSDP2) -> materialize on the real
device with ``init_weights`` -> ZeRO 0-2 engine or optimizer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchpar.config import ConfigError, Parallelism, Training
from torchpar.models import MODELS
from torchpar.parallel.data import FlatZero, FSDPState, apply_fsdp, unique_params
from torchpar.parallel.dims import ParallelDims
from torchpar.parallel.tensor import apply_tensor_parallel

def validate_layout(par: Parallelism, tr: Training, dims: ParallelDims, args) -> int:
    """Every layout check that needs no process group; returns gradient-accumulation steps."""
    dims.check_model(args, tr.seq_len, par.sequence_parallel)
    if tr.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len = {tr.seq_len} exceeds the model's max_seq_len {args.max_seq_len}")
    if par.zero_stage != 3 and (tr.mixed_precision_param != "float32" or tr.mixed_precision_reduce != "float32"):
        raise ConfigError(
            f"training.mixed_precision_param/reduce = {tr.mixed_precision_param}/{tr.mixed_precision_reduce} needs "
            "parallelism.zero_stage = 3 (FSDP2's MixedPrecisionPolicy); zero stages 0-2 train in float32")
    if tr.compile and dims.tp > 1:
        # Both fail inside torch 2.13's compiler: DTensor parameters whose local parts alias one
        # storage (the flat ZeRO 0-2 engine), and a checkpoint wrapper around DTensor code.
        if par.zero_stage != 3:
            raise ConfigError("training.compile = true with tensor parallelism needs parallelism.zero_stage = 3 "
                              "(zero stages 0-2 keep TP shards in one flat buffer, which torch.compile cannot trace); "
                              "use zero_stage = 3 or compile = false")
        if tr.activation_checkpoint != "none":
            raise ConfigError("training.compile = true with tensor parallelism and training.activation_checkpoint = "
                              f"{tr.activation_checkpoint!r} fails inside torch.compile; drop one of the three")
    if par.cpu_offload and par.zero_stage != 3:
        raise ConfigError("parallelism.cpu_offload needs parallelism.zero_stage = 3 (FSDP2's CPUOffloadPolicy)")
    accum = dims.grad_accum_steps(tr.local_batch_size, tr.global_batch_size)
    if dims.pp > 1:
        from torchpar.parallel.pipeline import validate_pipeline

        validate_pipeline(par, tr, dims, args, accum)
    return accum


def _local_part(p: torch.Tensor, full: torch.Tensor):
    """(destination, source) for init: the piece of ``full`` this rank holds of a DTensor."""
    if isinstance(p, DTensor):
        # src_data_rank=None: every rank cuts its own piece from its own copy, no communication.
        return p.to_local(), distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return p, full


@dataclass
class ParallelModel:
    parts: list[nn.Module]  # the whole model, or this rank's pipeline stages
    state: object  # FlatZero (stages 0-2) or FSDPState (stage 3): gradients + optimizer
    pipeline: object | None  # torchpar.parallel.pipeline.Pipeline when pp > 1


def build_parallel_model(model_name: str, par: Parallelism, tr: Training, args, dims: ParallelDims,
                         device: torch.device, build_optimizer, accum: int,
                         initial_weights: dict[str, torch.Tensor] | None = None) -> ParallelModel:
    """The model ``model_name`` with ``args``, laid out by ``par``; ``tr`` gives the seed, the batch
    (pipeline microbatches), precision, recomputation and compile. ``initial_weights``: full
    tensors by canonical name to start from instead of the seeded init."""
    with torch.device("meta"):
        model = MODELS[model_name](args)
    pipeline = None
    if dims.pp > 1:
        from torchpar.parallel.pipeline import split_model

        parts, pipeline_spec = split_model(model, par, dims)
    else:
        parts = [model]
    for part in parts:
        if dims.tp > 1:
            apply_tensor_parallel(part, dims.mesh["tp"], par.sequence_parallel, par.loss_parallel)
        if tr.activation_checkpoint == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for key, block in list(part.layers.items()):
                part.layers[key] = checkpoint_wrapper(block)
        if tr.compile:
            for block in part.layers.values():
                block.compile()
        if par.zero_stage == 3:
            dp_mesh = dims.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else dims.mesh["dp_shard"]
            # With a pipeline every microbatch would re-gather the blocks; and zero-bubble schedules
            # give wrong gradients when blocks reshard between forward and backward (TORCH_NOTES).
            apply_fsdp(part, dp_mesh, getattr(torch, tr.mixed_precision_param), getattr(torch, tr.mixed_precision_reduce),
                       reshard_after_forward=dims.pp == 1, cpu_offload=par.cpu_offload)
    # device "meta" = a shape-only build (the planner's check on fake process groups): parameters
    # and state become fake CPU tensors that have shapes and no storage.
    shapes_only = device.type == "meta"
    if shapes_only:
        from torch._subclasses.fake_tensor import FakeTensorMode

        device = torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) if shapes_only else contextlib.nullcontext():
        for part in parts:
            part.to_empty(device="cpu" if par.cpu_offload else device)
            part.tie_weights()  # to_empty makes new parameter objects for plain tensors
            part.init_weights(tr.seed, local_part=_local_part, buffer_device=device, values=initial_weights)
        if par.zero_stage == 3:
            state = FSDPState(parts, build_optimizer(unique_params(parts)), dims.tp)
        else:
            state = FlatZero(parts, dims, par.zero_stage, build_optimizer)
    if dims.pp > 1 and not shapes_only:
        from torchpar.parallel.pipeline import Pipeline

        pipeline = Pipeline(parts, pipeline_spec, par, tr, dims, device, accum)
    return ParallelModel(parts, state, pipeline)
