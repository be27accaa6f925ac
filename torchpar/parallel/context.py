"""Context parallelism: each sequence split over the ``cp`` ranks, attention over the whole of it.

Load balance: a sequence of S tokens is cut into 2 x cp chunks and rank r holds chunks r and
2cp-1-r (head and tail, in that order), so that under a causal mask every rank attends over the
same number of (query, key) pairs. Everything else in a block is per token, so only attention
talks to the other ranks, in one of two ways (``parallelism.context_parallel_method``):

* ``alltoall``: one all-to-all trades the sequence split of q, k and v for a head split (each
  rank then holds every token of 1/cp of the heads), attention runs as on one device —
  per-document masking and grouped-query heads included — and a second all-to-all trades the
  output back; heads (and KV heads, per TP rank) must divide by cp.
* ``ring``: the heads stay; key/value blocks pass around the ranks (cp - 1 hops) while each rank
  merges its queries' partial attention by log-sum-exp. torch's templated ring forward and
  backward (private, called only in the ``torchpar::ring_attention`` op below) drive the device's
  attention kernel: on CPU the CPU flash op, on CUDA the memory-efficient one. One causal mask
  over the window. The blocks travel with their own KV heads (grouped-query attention: 1/g of the
  bytes for g query heads a KV head); each hop repeats them to the query heads just for the
  kernel, and folds the key/value gradients back by summing over each group. Being one op,
  selective recomputation keeps its merged output (as it keeps a fused attention's) rather than
  every hop's partial result.

The model never sees a process group: a forward pre-hook (:func:`apply_context_parallel`) turns
the full-length ``documents`` input (or none) into a :class:`ContextShard`, which gives the model
each local token's position and serves its attention calls (``models.common.SequenceShard``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_ring

from torchpar.loss import targets_of, token_ids
from torchpar.models.common import SequenceShard, attention, document_layout, repeat_kv, with_values_as_wide


@functools.cache
def _order(cp: int, rank: int, seq: int, device: torch.device) -> torch.Tensor:
    """The positions rank ``rank`` of ``cp`` holds of a sequence of ``seq`` tokens: chunks
    ``rank`` and ``2cp - 1 - rank`` of ``2cp``."""
    n = seq // (2 * cp)
    return torch.cat([torch.arange(rank * n, (rank + 1) * n),
                      torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n)]).to(device)


def shard_sequence(t: torch.Tensor, layout) -> torch.Tensor:
    """This rank's tokens of ``t`` [b, S, ...] (ids, targets): its two chunks along dim 1."""
    if layout.cp == 1:
        return t
    return t[:, _order(layout.cp, layout.coordinate("cp"), t.shape[1], t.device)]


def inputs_and_targets(rows: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows [b, S + 1] -> this rank's inputs (token ids) and targets (each input's next token,
    IGNORE where it carries the NO_LOSS bit) [b, S / cp]."""
    return shard_sequence(token_ids(rows[:, :-1]), layout), shard_sequence(targets_of(rows[:, 1:]), layout)


class ContextShard(SequenceShard):
    """The part of each sequence this rank holds, as the model sees it (one per forward)."""

    def __init__(self, layout, seq: int, documents: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        self.cp, self.method = layout.cp, layout.cp_method
        self.mesh = layout.submesh("cp")
        index = _order(self.cp, self.mesh.get_local_rank(), seq, device)
        if documents is None:
            self.positions, self.mask = index.unsqueeze(0), None  # [1, s_local]; causal over the window
        else:  # positions inside each document, and the mask over the whole sequence
            full, self.mask = document_layout(documents, dtype, device)
            self.positions = full[:, index]  # [b, s_local]

    @torch.compiler.disable  # collectives and host-side layout: eager between compiled graphs
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None,
               window: int = 0) -> torch.Tensor:
        if self.method == "ring":
            if sinks is not None or window:  # (the composition table refuses this before launch)
                raise ValueError("the ring's kernels take neither attention sinks nor a sliding window")
            return _ring_attention(q, k, v, self.mesh)
        q, k, v = self._to_heads(q, k, v)  # [b, h/cp, S, hd], [b, h_kv/cp, S, hd] x 2
        if sinks is not None:  # this rank's share of the heads: group j of cp went to rank j
            sinks = sinks.view(self.cp, -1)[self.mesh.get_local_rank()]
        return self._to_sequence(attention(q, k, v, self.mask, sinks, window))

    def _to_heads(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each of ``ts`` [b, h_i, s, hd_i] (this rank's tokens, all its heads) -> [b, h_i/cp, cp*s,
        hd_i] (the whole sequence in order, this rank's share of the heads), in one all-to-all."""
        b, _, s, _ = ts[0].shape
        cp = self.cp
        # head group j of every tensor -> rank j: each tensor copied once, into its columns of the
        # send buffer (their head widths may differ: latent attention's values)
        sizes = [t.numel() // cp for t in ts]
        send = ts[0].new_empty(cp, sum(sizes))
        start = 0
        for t, size in zip(ts, sizes):  # (narrow, not split: autograd takes an in-place copy into one view)
            n, hd = t.shape[1] // cp, t.shape[3]
            send.narrow(1, start, size).view(cp, b, n, s, hd).copy_(t.reshape(b, cp, n, s, hd).movedim(1, 0))
            start += size
        got = all_to_all_single_autograd(send.flatten(), None, None, self.mesh.get_group()).view(cp, -1)
        out = []
        for t, part in zip(ts, got.split(sizes, dim=1)):
            hd = t.shape[3]
            part = part.reshape(cp, b, t.shape[1] // cp, 2, s // 2, hd)  # from rank j: chunks j, 2cp-1-j
            front = part[:, :, :, 0].movedim(0, 2).flatten(2, 3)  # chunks 0 .. cp-1
            back = part[:, :, :, 1].flip(0).movedim(0, 2).flatten(2, 3)  # chunks cp .. 2cp-1
            out.append(torch.cat([front, back], dim=2))
        return tuple(out)

    def _to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_to_heads`."""
        b, hh, full, hd, cp = *t.shape, self.cp
        halves = t.view(b, hh, 2, cp, full // (2 * cp), hd)
        send = torch.stack([halves[:, :, 0], halves[:, :, 1].flip(2)], dim=3)  # [b, hh, cp, 2, n, hd]
        send = send.movedim(2, 0).contiguous()  # rank j's two chunks -> rank j
        got = all_to_all_single_autograd(send.flatten(), None, None, self.mesh.get_group())
        out = got.view(cp, b, hh, full // cp, hd).movedim(0, 1).reshape(b, cp * hh, full // cp, hd)
        # At b = 1 the reshape is a view of the all-to-all's buffer, which torch.compile's next graph
        # cannot take as its input (its fake tensor cannot rebuild the view): a tensor of its own.
        return out.clone() if out._is_view() else out


def apply_context_parallel(part: nn.Module, layout) -> None:
    """Give ``part`` (a model or pipeline stage) its :class:`ContextShard` at every forward: the
    caller passes this rank's tokens (:func:`shard_sequence`) and the full-length ``documents``."""
    if layout.cp == 1:
        return

    def hook(module, args, kwargs):
        x, documents = args[0], kwargs.get("documents")
        seq = layout.cp * x.shape[1]
        if x.is_floating_point() and layout.sequence_parallel:
            seq *= layout.tp  # hidden states between pipeline stages are sequence-sharded over tp
        shard = ContextShard(layout, seq, documents, getattr(torch, layout.param_dtype), x.device)
        return args, {**kwargs, "documents": shard}

    part.register_forward_pre_hook(hook, with_kwargs=True)


# ---------------------------------------------------------------------------- ring


@functools.cache
def _ring_kernels(device_type: str):
    """(forward op, its keyword arguments, backward op, the backward's name for the output's
    gradient, its keyword arguments): the flash kernel on CPU, the memory-efficient one on CUDA
    (any dtype; the flash one takes half precision only)."""
    aten = torch.ops.aten
    if device_type == "cuda":
        return (aten._scaled_dot_product_efficient_attention,
                {"attn_bias": None, "compute_log_sumexp": True, "dropout_p": 0.0},
                aten._scaled_dot_product_efficient_attention_backward.default, "grad_out_",
                {"attn_bias": None, "dropout_p": 0.0, "grad_input_mask": (True, True, True, False)})
    return (aten._scaled_dot_product_flash_attention_for_cpu, {"dropout_p": 0.0},
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "grad_out", {"dropout_p": 0.0})


@contextlib.contextmanager
def _ring_options():
    """torch's ring options, for one call: head-tail load balance (our layout), fp32 merging,
    and key/value passed rank to rank (not all-gathered: a rank never holds every block)."""
    opts = torch_ring._cp_options
    saved = (opts.enable_load_balance, opts.convert_to_f32, opts.rotate_method)
    opts.enable_load_balance, opts.convert_to_f32 = True, True
    opts.rotate_method = torch_ring._RotateMethod.ALL_TO_ALL
    try:
        yield torch_ring
    finally:
        opts.enable_load_balance, opts.convert_to_f32, opts.rotate_method = saved


def _folded(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of repeated heads [b, h, s, hd] summed back to the KV heads [b, h / groups, s, hd]
    in fp32 (the ring accumulates key/value gradients in fp32)."""
    if groups == 1:
        return grad
    b, h, s, hd = grad.shape
    return grad.view(b, h // groups, groups, s, hd).sum(2, dtype=torch.float32)


def _grouped_forward(kernel, groups: int):
    """The ring's forward kernel for blocks of KV heads: repeated to the query heads per call."""
    def op(q, k, v, **kwargs):
        return kernel(q, *repeat_kv(k, v, groups), **kwargs)
    return op


def _grouped_backward(kernel, groups: int):
    """The ring's backward kernel for blocks of KV heads: the key/value gradients folded back."""
    def op(query, key, value, **kwargs):
        key, value = repeat_kv(key, value, groups)
        dq, dk, dv, *rest = kernel(query=query, key=key, value=value, **kwargs)
        return (dq, _folded(dk, groups), _folded(dv, groups), *rest)
    return op


@torch.library.custom_op("torchpar::ring_attention", mutates_args=())
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, h, s, hd], k and v [b, h_kv, s, hd] of this rank, ``group`` the cp group's name ->
    (output, log-sum-exp, and CUDA's dropout seed and offset (unused at p = 0; empty on CPU))."""
    forward, kwargs, *_ = _ring_kernels(q.device.type)
    op = _grouped_forward(forward, q.shape[1] // k.shape[1])
    with _ring_options() as ring:
        out, lse, *rest = ring._templated_ring_attention(_resolve_process_group(group), 2, op, q, k, v,
                                                         is_causal=True, **kwargs)
    seed, offset = rest if rest else (q.new_empty(0), q.new_empty(0))
    return out, lse, seed, offset


@ring_attention.register_fake
def _(q, k, v, group):
    b, h, s, _ = q.shape
    lse_len = -(-s // 32) * 32 if q.device.type == "cuda" else s  # (CUDA's kernel pads it)
    empty = q.new_empty(0) if q.device.type != "cuda" else q.new_empty((), dtype=torch.int64)
    return torch.empty_like(q), q.new_empty((b, h, lse_len), dtype=torch.float32), empty, empty.clone()


def _ring_context(ctx, inputs, output) -> None:
    q, k, v, ctx.group = inputs
    ctx.save_for_backward(q, k, v, *output)


def _ring_backward(ctx, grad_out, *_):
    q, k, v, out, lse, seed, offset = ctx.saved_tensors
    _, _, backward, name, kwargs = _ring_kernels(q.device.type)
    if q.device.type == "cuda":
        kwargs = {**kwargs, "philox_seed": seed, "philox_offset": offset}
    op = _grouped_backward(backward, q.shape[1] // k.shape[1])
    with _ring_options() as ring:
        dq, dk, dv, *_ = ring._templated_ring_attention_backward(
            _resolve_process_group(ctx.group), 2, op, grad_out.contiguous(), name, q, k, v, out, lse,
            is_causal=True, **kwargs)
    return dq, dk, dv, None


ring_attention.register_autograd(_ring_backward, setup_context=_ring_context)


def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys: q [b, h, s, hd], k [b, h_kv,
    s, hd] and v [b, h_kv, s, vd], each rank's two chunks of the sequence -> [b, h, s, vd]."""
    if v.shape[-1] < q.shape[-1]:
        return with_values_as_wide(lambda q, k, v: _ring_attention(q, k, v, mesh), q, k, v)
    group = mesh.get_group().group_name
    return ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), group)[0]
