"""Data parallelism and the ZeRO stages (stage 3 itself is in ``fsdp.py``).

Stage 3 is FSDP2 (``fully_shard`` per block, then the root). Stages 0-2 are
:class:`~torchpar.parallel.flat.FlatZero`, a short engine over one flat buffer that the model's
(local) parameters alias, written so the three stages differ only in which collectives run and
how much of the buffer this rank's optimizer owns:

==========  ===========================================  ===============================
stage       gradients after backward                     optimizer updates
==========  ===========================================  ===============================
0 (DDP)     all-reduce over dp, bucket by bucket in      the whole buffer, on every rank
            backward (full grads everywhere)
1           the same                                      its 1/N of each bucket, then
                                                          all-gather
2           reduce-scatter over dp_shard per bucket in    its 1/N of each bucket, then
            backward (+ all-reduce over dp_replicate);    all-gather
            only the owned pieces are kept
3 (FSDP2)   reduce-scatter in backward, per block         its shard of every parameter
==========  ===========================================  ===============================

Both keep the gradient reduction an average over the dp ranks (the trainer scales the loss by
the dp degree so the result is the gradient of the globally normalized loss), and both are a
:class:`ZeroState` to the trainer. Both write the optimizer state in one format, keyed by
parameter name (``state.<name>.exp_avg`` ...) with each tensor laid out like its parameter, so a
checkpoint saved by one stage loads into the other under any layout.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchpar.models.common import canonical_name


class ZeroState(Protocol):
    """What the trainer and the checkpointer ask of a ZeRO engine (:class:`FlatZero` for stages
    0-2, :class:`FSDPState` for stage 3)."""

    optimizer: torch.optim.Optimizer

    def set_sync(self, enabled: bool) -> None:
        """Whether this micro-step's backward reduces gradients (the last one does)."""

    def reduce_gradients(self) -> None:
        """Finish the gradient reduction after the last micro-step."""

    def grad_pieces(self) -> list[tuple[torch.Tensor, int]]:
        """The reduced gradient values this rank holds, each with how many ranks hold the same."""

    def scale_grads(self, coef: torch.Tensor) -> None: ...

    def step(self) -> None:
        """Optimizer step (and whatever must follow it, e.g. gathering updated parameters)."""

    def wait_params(self) -> None:
        """Finish the update: parameters still being gathered after :meth:`step` (each forward
        waits for its own; anything else that reads parameters calls this first)."""

    def zero_grad(self) -> None: ...

    def state_bytes(self) -> dict[str, int]:
        """This rank's parameter, gradient and optimizer-state bytes."""

    def weights(self) -> list[torch.Tensor]:
        """The weights this rank's optimizer updates (its fp32 master pieces)."""

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's fp32 weights by canonical name, laid out like the parameters."""

    def model_load_template(self) -> dict:
        """What a resume loads into, in place (a save may write a share of what a rank holds)."""

    def load_model_state_dict(self, sd: dict[str, torch.Tensor]) -> None: ...

    def optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        """Adam's state per parameter name (``state.<name>.exp_avg`` ...), laid out like the parameter."""

    def optimizer_load_template(self) -> dict: ...

    def load_optimizer_state_dict(self, loaded: dict[str, torch.Tensor]) -> None: ...


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of this rank's piece of ``t`` (all of it, unless a DTensor)."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(shape), tuple(offset)
    return tuple(t.shape), (0,) * t.dim()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered over its mesh if it is a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``p.grad``, laid out like the parameter (a TP gradient can come back
    with another placement, e.g. replicated for a row-sharded embedding)."""
    g = p.grad
    if isinstance(g, DTensor):
        if g.placements != p.placements:
            g = g.redistribute(placements=p.placements)
        return g.to_local()
    return g


def nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = local(t)
    return t.numel() * t.element_size()


def unique_params(model_parts: list[nn.Module]) -> list[nn.Parameter]:
    seen, out = set(), []
    for m in model_parts:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def param_names(model_parts: list[nn.Module]) -> list[str]:
    """Canonical names in :func:`unique_params` order (a tied weight under its first name)."""
    seen, out = set(), []
    for m in model_parts:
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(canonical_name(name))
    return out


def frozen_names(model_parts: list[nn.Module]) -> frozenset[str]:
    """Canonical names (every alias) of the parameters nothing trains (LoRA's base)."""
    return frozenset(canonical_name(n) for part in model_parts
                     for n, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad)


def merged_view(model_parts: list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the unsplit model's, over a rank's pipeline stages
    (the state-dict helpers map an optimizer's parameters to names through one module)."""
    if len(model_parts) == 1:
        return model_parts[0]
    view = nn.Module()
    view.layers = nn.ModuleDict()
    for part in model_parts:
        for name, child in part.named_children():
            if name == "layers":
                view.layers.update(child)  # keyed by global layer index: no clashes
            elif child is not None:
                setattr(view, name, child)
    return view


def parts_state_dict(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The parameters (and persistent buffers) of a rank's model parts by canonical name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: v for part in model_parts for k, v in get_model_state_dict(part).items()}


def load_parts_state_dict(model_parts: list[nn.Module], sd: dict[str, torch.Tensor]) -> None:
    """``sd``'s entries into the parts that hold them (a checkpoint without LoRA's frozen base
    leaves those weights as they are)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    for part in model_parts:
        mine = {k: sd[k] for k in get_model_state_dict(part) if k in sd}
        set_model_state_dict(part, mine, options=StateDictOptions(strict=False))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )


def replicas(t: torch.Tensor, tp: int) -> int:
    """How many ranks of this tensor's mesh (and of tp) hold an identical copy of its local part."""
    if not isinstance(t, DTensor):
        return tp  # a plain parameter next to TP-sharded ones is replicated over tp
    n = 1
    for size, placement in zip(t.device_mesh.shape, t.placements):
        if isinstance(placement, Replicate):
            n *= size
    # A parameter TP left alone (a norm without sequence parallel) is a copy on every tp rank.
    return n if "tp" in (t.device_mesh.mesh_dim_names or ()) else n * tp


def shaped_like(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (this rank's piece of ``p``, flat) as a tensor laid out like ``p``."""
    piece = values.view(local(p).shape)
    if isinstance(p, DTensor):
        return DTensor.from_local(
            piece, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return piece


def clip_grad_norm(state, max_norm: float, device: torch.device, world_group=None) -> torch.Tensor:
    """The true global gradient norm over every mesh dimension, and clipping to ``max_norm``.

    Each rank sums the squares of the gradient values it holds, divided by how many ranks hold
    identical copies; one all-reduce over the whole world then counts every value exactly once
    (TP shards, FSDP shards, pipeline stages and replicas alike). ``device``: where the gradients
    live (the host under CPU offload); a rank that holds none still takes part in the all-reduce
    from there — a host tensor has no backend in an NCCL-only group.
    """
    pieces = state.grad_pieces()
    total = torch.zeros((), dtype=torch.float32, device=pieces[0][0].device if pieces else device)
    by_copies: dict[int, list[torch.Tensor]] = {}
    for t, copies in pieces:
        by_copies.setdefault(copies, []).append(t)
    for copies, group in by_copies.items():  # one fused kernel per group, not three per piece
        total += torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).square().sum() / copies
    if dist.get_world_size(world_group) > 1:
        dist.all_reduce(total, group=world_group)
    norm = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        state.scale_grads(coef)
    return norm
