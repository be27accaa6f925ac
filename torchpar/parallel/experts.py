"""Expert parallelism (EP) and the tensor parallelism of experts, applied to a model from outside.

A mixture-of-experts layer hands its expert module the rows of its (token, expert) slots sorted by
expert, with the count per expert; the module's ``run(x, counts, *weights)`` computes them with the
stacked weights it is given ([experts, ...] each), and ``finish(out, counts, *whole)`` adds what
each row takes once (an output bias) with the weights TP leaves whole. The adapter's
``expert_plan`` names such modules inside a block and, per weight, the dimension TP splits (the
hidden width), or None for one TP leaves whole (a weight the module may lack). Here their weights
become DTensors: split along the experts over ``ep`` (each rank keeps experts / ep of them) and
along the hidden width over ``tp``; and their forward becomes:

1. the counts exchanged (an all-to-all of ``experts`` integers): how many rows each rank of the
   ep group sends to each of my experts — the one host sync, for the split sizes;
2. the rows sent to their experts' ranks (an uneven all-to-all; autograd through torch's
   functional collectives sends the gradients back the same way);
3. the received rows (grouped by source rank) regrouped by local expert, computed by grouped GEMM
   on the local weights (under TP each rank's hidden units give partial sums, all-reduced over tp),
   and put back in arrival order;
4. the rows returned by the reverse all-to-all, in the order they were sent.

The ranks of a tp group hold the same tokens (the layer's input is replicated), so they route
alike and send the same rows; each ep group is one tp coordinate's. Nothing here knows a model:
the row order, the weights' roles and the computation are the module's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchpar.parallel.tensor import submodule
from torchpar.parallel.zero import local


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the input gradient's partial sums (one per tp rank's hidden units)
    all-reduced in backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = torch.clone(grad, memory_format=torch.contiguous_format)  # (autograd's buffer stays as it is)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """The partial sums of the tp ranks all-reduced forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = torch.clone(x, memory_format=torch.contiguous_format)  # (the input is not changed in place)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def regroup(sizes: torch.Tensor, n: int) -> torch.Tensor:
    """The order that takes the ``n`` rows arriving in blocks ``sizes`` [sources, experts]
    (source-major) to expert-major blocks (each expert's rows from source 0, then 1, ...):
    ``rows[order]``. ``n`` (their sum) comes from the host: reading it here would wait for the device."""
    flat = sizes.flatten()
    arrival = torch.cumsum(flat, 0) - flat  # where block (source, expert) starts on arrival
    by_expert = sizes.t().flatten()
    starts = arrival.view_as(sizes).t().flatten()
    out_starts = torch.cumsum(by_expert, 0) - by_expert
    shift = torch.repeat_interleave(starts - out_starts, by_expert, output_size=n)
    return shift + torch.arange(n, device=sizes.device)


def expert_parallel_forward(module: nn.Module, x: torch.Tensor, counts: torch.Tensor, names: tuple[str, ...],
                            whole: tuple[str, ...], ep_group, tp_group) -> torch.Tensor:
    """``module``'s forward under EP (``ep_group``, or None) and TP of its hidden width
    (``tp_group``, or None): x [n, d] sorted by expert, ``counts`` [experts] -> [n, d]. ``names``:
    the weights TP splits, ``whole`` those it leaves whole (for ``finish``)."""
    # this rank's experts (and hidden units); None for a weight the module lacks
    weights, rest = ([None if getattr(module, w) is None else local(getattr(module, w)) for w in group]
                     for group in (names, whole))

    def compute(rows, counts):  # (the tp ranks' partial sums added, then what each row takes once)
        out = _reduce_from_tp(module.run(_copy_to_tp(rows, tp_group), counts, *weights), tp_group)
        return module.finish(out, counts, *rest)

    if ep_group is None:
        return compute(x, counts)
    ep = dist.get_world_size(ep_group)
    mine = weights[0].shape[0]  # experts held here
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep_group)  # [ep sources x mine]
    sizes = received.view(ep, mine)
    send, recv = torch.stack([counts.view(ep, mine).sum(1), sizes.sum(1)]).tolist()  # one host sync
    order = regroup(sizes, sum(recv))
    rows = all_to_all_single_autograd(x, recv, send, ep_group)[order]
    out = compute(rows, sizes.sum(0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return all_to_all_single_autograd(out[back], send, recv, ep_group)


def _copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def _reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def apply_experts(part: nn.Module, model, layout) -> list[nn.Module]:
    """Split the expert modules of ``part``'s blocks (the adapter ``model``'s ``expert_plan``) over
    the layout's ``ep`` ranks (experts) and ``tp`` ranks (hidden width), and route their forward
    through :func:`expert_parallel_forward`. On the meta device: nothing is allocated. Returns the
    modules, for ZeRO-3 to shard each over the data-parallel ranks that hold the same experts."""
    mesh, ep, tp = layout.expert_mesh, layout.ep, layout.tp
    if mesh is None:
        return []
    groups = {"ep_group": mesh["ep"].get_group() if ep > 1 else None,
              "tp_group": mesh["tp"].get_group() if tp > 1 else None}
    done = []
    for block in part.layers.values():
        for name, tp_dims in model.expert_plan.items():
            module = submodule(block, name)
            if module is None:
                continue
            for weight, tp_dim in tp_dims.items():
                p = getattr(module, weight)
                if p is None:
                    continue
                shape = list(p.shape)
                shape[0] //= ep
                if tp_dim is not None:
                    shape[tp_dim] //= tp
                places = ([Shard(0)] if ep > 1 else []) + (
                    [Shard(tp_dim) if tp_dim is not None else Replicate()] if tp > 1 else [])
                piece = torch.empty(shape, dtype=p.dtype, device=p.device)
                dt = DTensor.from_local(piece, mesh, places, run_check=False, shape=p.shape,
                                        stride=p.stride())
                setattr(module, weight, nn.Parameter(dt, requires_grad=p.requires_grad))
            module.forward = functools.partial(
                expert_parallel_forward, module, names=tuple(w for w, d in tp_dims.items() if d is not None),
                whole=tuple(w for w, d in tp_dims.items() if d is None), **groups)
            done.append(module)
    return done

