"""One parallelize path for every model family and layout.

Order (as in torchtitan): build on the meta device -> FP8 layers ([quantize]) -> LoRA adapters
([lora]: the rest frozen) -> pipeline split ->
per stage: context parallel (a forward pre-hook) -> tensor parallel -> experts split over ep (and
tp) ranks -> activation checkpointing -> compile ->
ZeRO-3 (FSDP2) -> materialize on the real device with ``init_weights`` -> ZeRO 0-2 engine or
optimizer. The model is known only through its adapter (``torchpar.models``), the layout only
through :class:`~torchpar.parallel.layout.Layout`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchpar.models.lora import add_adapters, freeze_base
from torchpar.parallel import float8
from torchpar.parallel.context import apply_context_parallel
from torchpar.parallel.experts import apply_experts
from torchpar.parallel.flat import FlatZero
from torchpar.parallel.fsdp import FSDPState, apply_fsdp
from torchpar.parallel.layout import Layout
from torchpar.parallel.pipeline import Pipeline, split_model
from torchpar.parallel.recompute import apply_recompute
from torchpar.parallel.tensor import apply_tensor_parallel, loss_context
from torchpar.parallel.zero import ZeroState, local_box, param_names, unique_params


def _local_part(p: torch.Tensor, full):
    """(destination, source) for init: the piece of ``full`` this rank holds of a DTensor.
    ``full`` is a tensor, or a lazy weight (``read(index)``) of which only that piece is read."""
    if hasattr(full, "read"):
        if not isinstance(p, DTensor):
            return p, full.read()
        shape, offset = local_box(p)
        return p.to_local(), full.read(tuple(slice(o, o + n) for o, n in zip(offset, shape)))
    if isinstance(p, DTensor):
        # src_data_rank=None: every rank cuts its own piece from its own copy, no communication.
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        return p.to_local(), local.to_local()
    return p, full


@dataclass
class ParallelModel:
    parts: list[nn.Module]  # the whole model, or this rank's pipeline stages
    state: ZeroState  # gradients + optimizer
    pipeline: object | None  # torchpar.parallel.pipeline.Pipeline when pp > 1


@contextlib.contextmanager
def compute_context(layout: Layout):
    """What every forward (and its loss) runs under: loss parallelism with TP. (bf16 needs no
    autocast: the ZeRO engines hand forward parameters in the compute dtype.)"""
    with loss_context(layout.loss_parallel):
        yield


def parallelize(model, args, layout: Layout) -> list[nn.Module]:
    """The meta model of adapter ``model`` with ``args``, split into this rank's stages, each
    with context parallelism, TP, recomputation, compile and FSDP2 applied; nothing is allocated
    yet."""
    with torch.device("meta"):
        module = model.build(args)
    if layout.float8 != "off":
        float8.convert(module, model, layout.quantize, layout.float8_all_gather)
    if layout.lora_rank:
        add_adapters(module, model, layout.lora)
    if layout.pp > 1:
        parts = split_model(module, model, layout)
    else:
        parts = [module]
    for part in parts:
        apply_context_parallel(part, layout)
        if layout.tp > 1:
            apply_tensor_parallel(
                part, model, args, layout.submesh("tp"), layout.sequence_parallel, layout.loss_parallel
            )
        experts = apply_experts(part, model, layout)
        if layout.lora_rank:
            freeze_base(part)
            if layout.float8 != "off":
                float8.frozen_matmuls(part)
        apply_recompute(part, layout.activation_checkpoint, layout.activation_checkpoint_every)
        if layout.compile:
            for block in part.layers.values():
                block.compile()
        if layout.zero_stage == 3:
            # With a pipeline every microbatch would re-gather the blocks; and zero-bubble schedules
            # give silently wrong gradients when blocks reshard between forward and backward.
            apply_fsdp(part, layout.dp_mesh, getattr(torch, layout.param_dtype),
                       getattr(torch, layout.reduce_dtype), reshard_after_forward=layout.pp == 1,
                       cpu_offload=layout.cpu_offload,
                       experts=(experts, layout.expert_dp_mesh) if layout.ep > 1 else None)
    return parts


def materialize(parts: list[nn.Module], layout: Layout, device: torch.device, seed: int, build_optimizer,
                initial_weights: dict[str, torch.Tensor] | None = None) -> ZeroState:
    """Allocate and initialize the parallelized parts on ``device``; the ZeRO engine over them.
    ``build_optimizer(items)`` makes the optimizer over (canonical name, parameter, the tensor the
    optimizer updates) triples; its ``whole(name, parameter)``, where it has one, says which
    parameters the update needs whole (see :class:`torchpar.optim.OptimizerFactory`).
    Under ZeRO 0-2 the parameters are never allocated on their own: the engine makes its buffer
    and fills it one parameter's initial value at a time."""
    for part in parts:
        part.tie_weights()  # to_empty and sharding make new parameter objects for plain tensors
    if layout.zero_stage < 3:
        for part in parts:
            _buffers_to_empty(part, device)
        state = FlatZero(parts, layout, build_optimizer, device,
                         lambda part: part.initial_values(seed, _local_part, device, initial_weights),
                         getattr(build_optimizer, "whole", None))
        for part in parts:
            part.reset_buffers(device)
        return state
    for part in parts:
        part.to_empty(device="cpu" if layout.cpu_offload else device)
        part.tie_weights()
        part.init_weights(seed, local_part=_local_part, buffer_device=device, values=initial_weights)
    items = [(name, p, p) for name, p in zip(param_names(parts), unique_params(parts)) if p.requires_grad]
    after_update = (lambda: float8.precompute_scales(parts)) if layout.float8_all_gather else None
    if after_update is not None:
        after_update()  # (the first forward's scales too)
    return FSDPState(parts, build_optimizer(items), layout.tp, layout.reduce_every_microstep, layout.ep,
                     after_update)


def _buffers_to_empty(module: nn.Module, device: torch.device) -> None:
    """Every buffer allocated on ``device`` (left for ``reset_buffers``); parameters untouched."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty_like(b, device=device)


def build_parallel_model(model, args, layout: Layout, device: torch.device, seed: int, build_optimizer,
                         initial_weights: dict[str, torch.Tensor] | None = None) -> ParallelModel:
    """The model of adapter ``model`` with ``args``, laid out by ``layout`` (its mesh built).
    ``initial_weights``: full tensors by canonical name to start from instead of the seeded init."""
    parts = parallelize(model, args, layout)
    state = materialize(parts, layout, device, seed, build_optimizer, initial_weights)
    pipeline = None
    if layout.pp > 1:

        pipeline = Pipeline(parts, layout, device)
    return ParallelModel(parts, state, pipeline)
