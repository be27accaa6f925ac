"""Data parallelism and the ZeRO stages (stage 3 itself is in ``fsdp.py``).

Stage 3 is FSDP2 (``fully_shard`` per block, then the root). Stages 0-2 are :class:`FlatZero`,
a short engine over one flat fp32 buffer that the model's (local) parameters alias, written so
the three stages differ only in which collectives run and how much of the buffer this rank's
optimizer owns:

==========  ===========================================  ===============================
stage       gradients after backward                     optimizer updates
==========  ===========================================  ===============================
0 (DDP)     all-reduce over dp (full grads everywhere)    the whole buffer, on every rank
1           all-reduce over dp                            its 1/N slice, then all-gather
2           reduce-scatter over dp_shard (+ all-reduce    its 1/N slice, then all-gather
            over dp_replicate); only the slice is kept
3 (FSDP2)   reduce-scatter in backward, per block         its shard of every parameter
==========  ===========================================  ===============================

Both keep the gradient reduction an average over the dp ranks (the trainer scales the loss by
the dp degree so the result is the gradient of the globally normalized loss), and both are a
:class:`ZeroState` to the trainer. Both write the optimizer state in one format, keyed by
parameter name (``state.<name>.exp_avg`` ...) with each tensor laid out like its parameter, so a
checkpoint saved by one stage loads into the other under any layout.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from torchpar.models.common import canonical_name
from torchpar.optim import ensure_state


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

    def zero_grad(self) -> None: ...

    def state_bytes(self) -> dict[str, int]:
        """This rank's parameter, gradient and optimizer-state bytes."""

    def optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        """Adam's state per parameter name (``state.<name>.exp_avg`` ...), laid out like the parameter."""

    def load_optimizer_state_dict(self, loaded: dict[str, torch.Tensor]) -> None: ...


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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


class FlatZero:
    """ZeRO stages 0, 1 and 2 over one flat fp32 buffer (see the module docstring)."""

    def __init__(self, model_parts: list[nn.Module], layout, build_optimizer):
        self.stage, self.layout = layout.zero_stage, layout
        self.params = unique_params(model_parts)
        self.names = param_names(model_parts)
        tensors = [local(p) for p in self.params]
        dtypes = {t.dtype for t in tensors}
        if dtypes != {torch.float32}:
            raise ValueError(f"zero stages 0-2 keep fp32 parameters; got {dtypes}")
        self.shards = layout.dp_shard if self.stage in (1, 2) else 1
        mesh = layout.mesh
        self.dp_group = mesh["dp"].get_group()
        self.shard_group = mesh["dp_shard"].get_group()
        self.replicate_group = mesh["dp_replicate"].get_group()
        self.shard_rank = mesh["dp_shard"].get_local_rank() if self.shards > 1 else 0
        total = sum(t.numel() for t in tensors)
        padded = math.ceil(total / self.shards) * self.shards
        self.shard_size = padded // self.shards
        device = tensors[0].device
        self.flat = torch.zeros(padded, dtype=torch.float32, device=device)
        self.segments: list[tuple[int, int, int]] = []  # (start, end, tp copies) per parameter
        offset = 0
        with torch.no_grad():
            for p, t in zip(self.params, tensors):
                view = self.flat[offset: offset + t.numel()].view_as(t)
                view.copy_(t)
                # The parameter now lives in the flat buffer: updating the buffer updates the model.
                if isinstance(p, DTensor):
                    p._local_tensor = view
                else:
                    p.data = view
                self.segments.append((offset, offset + t.numel(), replicas(p, layout.tp)))
                offset += t.numel()
        lo = self.shard_rank * self.shard_size
        self.owned = (lo, lo + self.shard_size)
        self.master = self.flat[lo: lo + self.shard_size]  # the slice this rank's optimizer updates
        self.optimizer = build_optimizer([self.master])
        self.grad: torch.Tensor | None = None  # reduced gradient: full (stages 0, 1) or the slice (2)

    def set_sync(self, enabled: bool) -> None:
        pass  # gradients are reduced once, in reduce_gradients, after the last micro-step

    def reduce_gradients(self) -> None:
        full = torch.zeros_like(self.flat)
        for p, (start, end, _) in zip(self.params, self.segments):
            if p.grad is not None:
                full[start:end].copy_(local_grad(p).reshape(-1))
            p.grad = None  # the flat copy replaces the per-parameter gradients
        dp = self.layout.dp
        if self.stage == 2 and self.shards > 1:
            grad = torch.empty(self.shard_size, dtype=full.dtype, device=full.device)
            dist.reduce_scatter_tensor(grad, full, group=self.shard_group)
            del full
            if self.layout.dp_replicate > 1:
                dist.all_reduce(grad, group=self.replicate_group)
        else:
            grad = full
            if dp > 1:
                dist.all_reduce(grad, group=self.dp_group)
        self.grad = grad.div_(dp)
        # What this rank holds, and how many ranks hold the same reduced values.
        if self.stage == 2 and self.shards > 1:
            self.held, self.dp_copies = self.owned, self.layout.dp_replicate
        else:
            self.held, self.dp_copies = (0, self.flat.numel()), dp
        lo, hi = self.owned
        self.master.grad = grad if self.held == self.owned else grad[lo:hi]

    def grad_pieces(self) -> list[tuple[torch.Tensor, int]]:
        (held_lo, held_hi), dp_copies = self.held, self.dp_copies
        pieces = []
        for start, end, tp_copies in self.segments:
            a, b = max(start, held_lo), min(end, held_hi)
            if a < b:
                pieces.append((self.grad[a - held_lo: b - held_lo], tp_copies * dp_copies))
        return pieces

    def scale_grads(self, coef: torch.Tensor) -> None:
        self.grad.mul_(coef)

    def step(self) -> None:
        self.optimizer.step()
        if self.shards > 1:
            dist.all_gather_into_tensor(self.flat, self.master.clone(), group=self.shard_group)

    def zero_grad(self) -> None:
        self.grad = None
        self.master.grad = None
        for p in self.params:
            p.grad = None

    def state_bytes(self) -> dict[str, int]:
        return {"param_bytes": sum(nbytes(p) for p in self.params),
                "grad_bytes": nbytes(self.grad),
                "optim_bytes": optimizer_state_bytes(self.optimizer)}

    # Checkpoints: the flat slice's Adam moments, cut back into per-parameter tensors. Stages 1-2
    # gather the moments over dp_shard for this (a transient full copy: the price of a format
    # that any layout can load).

    def optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        ensure_state(self.optimizer)
        state = self.optimizer.state[self.master]
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            flat = state[key]
            if self.shards > 1:
                flat = torch.empty_like(self.flat)
                dist.all_gather_into_tensor(flat, state[key].contiguous(), group=self.shard_group)
            for name, p, (start, end, _) in zip(self.names, self.params, self.segments):
                out[f"state.{name}.{key}"] = _shaped_like(p, flat[start:end])
        for name in self.names:
            out[f"state.{name}.step"] = state["step"]
        return out

    def load_optimizer_state_dict(self, loaded: dict[str, torch.Tensor]) -> None:
        ensure_state(self.optimizer)
        state = self.optimizer.state[self.master]
        lo, hi = self.owned
        for key in ("exp_avg", "exp_avg_sq"):
            flat = torch.zeros_like(self.flat)
            for name, (start, end, _) in zip(self.names, self.segments):
                flat[start:end].copy_(local(loaded[f"state.{name}.{key}"]).reshape(-1))
            state[key].copy_(flat[lo:hi])
        state["step"].copy_(loaded[f"state.{self.names[0]}.step"])


def _shaped_like(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (this rank's piece of ``p``, flat) as a tensor laid out like ``p``."""
    piece = values.view(local(p).shape)
    if isinstance(p, DTensor):
        return DTensor.from_local(
            piece, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return piece


def clip_grad_norm(state, max_norm: float, world_group=None) -> torch.Tensor:
    """The true global gradient norm over every mesh dimension, and clipping to ``max_norm``.

    Each rank sums the squares of the gradient values it holds, divided by how many ranks hold
    identical copies; one all-reduce over the whole world then counts every value exactly once
    (TP shards, FSDP shards, pipeline stages and replicas alike).
    """
    pieces = state.grad_pieces()
    device = pieces[0][0].device if pieces else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for t, copies in pieces:
        total += t.float().pow(2).sum() / copies
    if dist.get_world_size(world_group) > 1:
        dist.all_reduce(total, group=world_group)
    norm = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        state.scale_grads(coef)
    return norm
