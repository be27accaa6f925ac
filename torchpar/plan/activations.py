"""Activation memory from the model's own structure, and its measurement.

What a block holds for backward is read off the block itself: one block is run on the meta device
(no memory, any size) under the layout's recomputation policy, and every storage its ops create
is followed until the forward ends — what is still alive then is what the block holds (saved
tensors, selective recomputation's kept outputs, the input a recomputed block keeps, its output).
Each storage is tagged with the tensor-parallel style of the module that created it (the model
adapter's block plan), which says how tensor and sequence parallelism divide it. Attention runs
as a fused kernel would (it keeps q, k, v, its output and the log-sum-exp, no score matrix).

The same tracker, on real tensors, measures a real run (``torchpar.verify``).
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchpar.loss import cross_entropy_sum
from torchpar.models import canonical_name
from torchpar.models.common import WHOLE_STYLES, planned_under
from torchpar.models.lora import adapted_in, add_adapters, first_adapted_block, freeze_base
from torchpar.models.lora import spec as lora_spec
from torchpar.parallel.recompute import apply_recompute, recomputed

NORM_OUTPUT = "norm output"  # a norm's result: gathered to full length before a column-wise linear


def _storage(t: torch.Tensor):
    return getattr(t, "_local_tensor", t).untyped_storage()  # a DTensor's: its local piece's


class LiveStorages(TorchDispatchMode):
    """Follows every storage an op creates under it, tagged with ``self.tag`` at creation."""

    def __init__(self, peak: bool = False):
        """``peak``: also keep the most bytes alive at once (checked after every op)."""
        super().__init__()
        self.tag, self.storages = ("rest", None), {}
        self.peak = 0 if peak else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: not a new one.
        given = {_storage(t)._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t)._cdata not in given:
                self.follow(t, self.tag)
        if self.peak is not None:
            self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(v[1] for v in self.storages.values()))
        return out

    def follow(self, t: torch.Tensor, tag) -> None:
        st = _storage(t)
        known = self.storages.get(st._cdata)
        if known is None or known[0].expired():
            self.storages[st._cdata] = (StorageWeakRef(st), st.nbytes(), tag)
        elif tag is not None and tag[1] == NORM_OUTPUT:
            self.storages[st._cdata] = (*known[:2], tag)

    def live(self) -> dict:
        """Bytes still alive, by tag."""
        out: dict = {}
        for ref, nbytes, tag in self.storages.values():
            if not ref.expired():
                out[tag] = out.get(tag, 0) + nbytes
        return out


@contextlib.contextmanager
def tagged(tracker: LiveStorages, modules: dict):
    """Tag what each module of ``modules`` (module -> (part, style)) creates while it runs; the
    innermost module wins, and a norm's output gets a tag of its own."""

    def enter(tag):
        def pre(module, args):
            stack.append(tracker.tag)
            tracker.tag = tag
        return pre

    def leave(module, args, out):
        tracker.tag = stack.pop()
        part, style = modules[module]
        if style == "norm":
            tracker.follow(out, (part, NORM_OUTPUT))

    stack: list = []
    handles = [h for m, tag in modules.items()
               for h in (m.register_forward_pre_hook(enter(tag)), m.register_forward_hook(leave))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class FusedAttention(TorchFunctionMode):
    """On the meta device, attention as the fused kernels run it (meta has none of its own)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and len(args) == 3:
            # (with a mask too: a sliding window's, or many documents' bias, which the fused CPU
            # kernel takes as the real step does; meta's math path would keep the s x s scores)
            q, k, v = args
            fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return fused(q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                         attn_mask=kwargs.get("attn_mask"), scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def styles_of(module, plan: dict, part: str) -> dict:
    """The modules of ``module`` named in an adapter's plan: module -> (part, style)."""

    named = {canonical_name(name): m for name, m in module.named_modules()}
    return {named[path]: (part, style) for path, style in plan.items() if path in named}


def _traced_plan(plan: dict[str, str]) -> dict[str, str]:
    """A block's plan as its trace is tagged: what a routed module holds is its own (traced with
    the rank's share of its widths: see ``traced_args``), except its row-wise outputs, which
    selective recomputation keeps twice (below)."""
    routed = planned_under(plan, "routed")
    return {m: w for m, w in plan.items() if w == "rowwise_replicated" or not m.startswith(routed)}


@functools.lru_cache(maxsize=256)
def traced(model, one, policy: str, dtype: torch.dtype, batch: int, seq: int, lora: tuple | None = None,
           grad_in: bool = True) -> dict:
    """Bytes the one-block model of args ``one`` (the adapter's ``traced_args``) and its loss hold
    at the end of the forward, on the meta device, by part ("block": the block; "rest": embedding,
    final norm, head and loss) and creating style. ``lora``: (rank, dropout, the block's layers
    LoRA adapts, by name in the block): those adapters added and every other parameter frozen, as
    the trainer does — a frozen weight keeps nothing for its own gradient — with the block's input
    carrying a gradient where ``grad_in`` (not before the first adapted block); None: no LoRA."""

    with torch.device("meta"):
        module = model.build(one)
    if lora is not None:
        rank, dropout, layers = lora
        add_adapters(module, model, SimpleNamespace(rank=rank, alpha=rank, dropout=dropout, exclude=(),
                                                    modules=[f"layers.0.{name}" for name in layers]))
        freeze_base(module)
        if grad_in:
            module.layers["0"].register_forward_pre_hook(_with_gradient)
    module.to(dtype)
    apply_recompute(module, policy)
    block = module.layers["0"]
    tags = {module: ("rest", None), **styles_of(module, model.top_plan, "rest"), block: ("block", "block"),
            **styles_of(block, _traced_plan(model.layer_plan(one, 0)), "block")}
    tokens = torch.zeros(batch, seq + 1, dtype=torch.long, device="meta")
    tracker = LiveStorages()
    with tagged(tracker, tags), FusedAttention(), tracker:
        loss = cross_entropy_sum(module(tokens[:, :-1]), tokens[:, 1:])
    held = {"block": {}, "rest": {}}
    for (part, style), nbytes in tracker.live().items():
        held[part][style] = nbytes
    del loss
    return held


def _with_gradient(block, args):
    """The block's input as one that carries a gradient (a trained block before it)."""
    return (args[0].detach().requires_grad_(), *args[1:])


def _lora_of(model, args, lay, layer: int | None) -> tuple[tuple | None, bool, int]:
    """For :func:`traced`: LoRA's (rank, dropout, layers adapted in block ``layer``, by name in the
    block) — None without LoRA —, whether the block's input carries a gradient, and the first
    adapted block (0 without LoRA). ``layer`` None: a block past the first adapted one, with every
    name adapted in any block (those its kind lacks match nothing in its trace)."""
    spec = lora_spec(lay.lora)
    if spec is None:
        return None, True, 0
    first = first_adapted_block(model, args, spec)
    if layer is None:
        every = (n for i in range(args.n_layers) for n in adapted_in(model, args, spec, i))
        names = tuple(dict.fromkeys(every))
    else:
        names = adapted_in(model, args, spec, layer)
    return (spec[0], lay.lora.dropout, names), layer is None or layer > first, first


# How tensor parallelism divides what a tp = 1 model holds, by creating style: "sp" = by tp only
# with sequence parallelism, "lp" = by tp only with loss parallelism.
# Modules every tp rank runs whole (latent attention's latents; a routed module, traced with its
# rank's share of the experts' hidden width, and its shared experts' reduced outputs): held whole.
DIVISOR = {"colwise": "tp", "input": "tp", "block": "sp", "norm": "sp", NORM_OUTPUT: "1", "embedding": "sp",
           "head": "lp", None: "lp", "whole_input": "tp", "routed": "1", "rowwise_replicated": "1",
           **dict.fromkeys(WHOLE_STYLES, "1")}


def divide(held: dict, lay, policy: str) -> float:
    """A tp = 1 model's bytes by style, as one rank holds them under tensor parallelism. Column-wise
    outputs and the attention and MLP interiors are sharded; the residual stream and a norm's
    interior are sharded along the sequence with sequence parallelism; a norm's output is held
    whole (gathered before the column-wise linears that keep it); logits and the loss's
    softmax are sharded with loss parallelism. A row-wise linear's output is reduce-scattered
    with sequence parallelism, else all-reduced — and selective recomputation keeps both the
    local matmul's full-size partial sums and the collective's result."""
    tp = lay.tp
    by = {"tp": tp, "sp": tp if lay.sequence_parallel else 1, "lp": tp if lay.loss_parallel else 1, "1": 1}
    total = 0.0
    for style, nbytes in held.items():
        if style in ("rowwise", "rowwise_replicated"):  # (inside a routed module: whole)
            whole = nbytes / by["sp" if style == "rowwise" else "1"]
            total += whole + (nbytes if policy == "selective" and tp > 1 else 0)
        else:
            total += nbytes / by[DIVISOR.get(style, "tp")]
    return total


def held_bytes(model, args, lay, batch: int, seq: int, policy: str, part: str = "block",
               layer: int | None = None) -> float:
    """Bytes block ``layer`` (``part = "block"``; None: the largest kind of block), or the embedding,
    final norm, head and loss (``"rest"``), hold for backward on one rank of layout ``lay``, per
    microbatch of sequences of ``seq`` tokens. Under context parallelism a rank holds seq / cp
    tokens of each, and its attention keeps as much as a fused kernel over them: all-to-all
    attention keeps q, k, v, the output and the log-sum-exp of seq tokens and 1/cp of the heads;
    ring attention keeps its own q, k and v (with their own KV heads: each hop repeats them for the
    kernel and lets the copies go), its output and log-sum-exp, as attention on one device keeps."""
    # Everything held is linear in the batch: traced for one sequence.
    dtype, local = getattr(torch, lay.param_dtype), seq // lay.cp
    one = model.traced_args(args, None if layer is None else model.block_kind(args, layer), lay.tp)
    lora, grad_in, first = _lora_of(model, args, lay, layer)
    if part == "rest" and lora is not None:
        return batch * divide(_lora_rest(model, args, lay, dtype, local), lay, "none")
    if part == "block" and layer is not None and layer < first:
        return 0.0  # (LoRA: no backward before the first adapted block, nothing kept for one)
    traces = traced(model, one, policy, dtype, 1, local, lora, grad_in)
    if lay.cp > 1 and lay.cp_method == "alltoall":
        whole = traced(model, one, policy, dtype, 1, seq, lora, grad_in)
        traces = {p: _over_whole_sequences(traces[p], whole[p], local, seq, lay.cp) for p in traces}
    held = dict(traces[part])
    if part == "block" and lora is not None and not grad_in and first and policy != "none":
        # The first adapted block, recomputed, keeps its input: the frozen blocks' output (in the
        # one-block trace, the embedding's).
        held["block"] = held.get("block", 0) + traces["rest"].get("embedding", 0)
    return batch * divide(held, lay, policy)


def _over_whole_sequences(local_held: dict, whole_held: dict, local: int, seq: int, cp: int) -> dict:
    """What a rank of all-to-all context parallelism holds, by style, from traces at its ``local``
    tokens and at the whole ``seq``: bytes = a x tokens + b x tokens^2 (the square: an attention
    that writes its s x s scores out, a sink's), and all-to-all attention runs over the whole
    sequence with 1/cp of the heads, so a rank holds a x local + b x seq^2 / cp."""
    out = {}
    for style in local_held.keys() | whole_held.keys():
        at_local, at_whole = local_held.get(style, 0), whole_held.get(style, 0)
        square = (at_whole / seq - at_local / local) / (seq - local)  # b
        out[style] = at_local + square * (seq * seq / cp - local * local)
    return out


def _lora_rest(model, args, lay, dtype: torch.dtype, seq: int) -> dict:
    """Under LoRA, what the embedding, final norm, head and loss hold, by style, for one sequence:
    the head and the loss as for any trained block before them (a frozen head keeps nothing for
    its own gradient), and the embedding's output only where the first block is adapted and
    recomputed (which keeps its input) — nothing else keeps it: the first block's norm is frozen
    and its input carries no gradient, and before the first adapted block nothing runs backward."""
    lora, _, first = _lora_of(model, args, lay, None)
    held = dict(traced(model, model.traced_args(args), "none", dtype, 1, seq, (*lora[:2], ()), True)["rest"])
    kept = (first == 0 and lay.activation_checkpoint != "none"
            and recomputed(0, lay.activation_checkpoint, lay.activation_checkpoint_every))
    held["embedding"] = held.get("embedding", 0) if kept else 0  # (the trace's block keeps it: its input)
    return held


def ends_bytes(model, args, lay, batch: int, seq: int, first: bool, last: bool) -> float:
    """Bytes the modules around the blocks hold, per microbatch: the embedding's output on the
    first stage; the final norm and the head on the last (the loss's own share is the planner's
    logits term)."""
    dtype = getattr(torch, lay.param_dtype)
    if lora_spec(lay.lora) is not None:
        held = _lora_rest(model, args, lay, dtype, seq // lay.cp)
    else:  # (the arguments as held_bytes passes them: one cache entry)
        held = traced(model, model.traced_args(args), "none", dtype, 1, seq // lay.cp, None, True)["rest"]
    styles = (("embedding",) if first else ()) + (("norm", NORM_OUTPUT, "head") if last else ())
    return batch * divide({s: n for s, n in held.items() if s in styles}, lay, "none")


def stage_activation_bytes(model, args, lay, batch: int, seq: int, first: int, layers: int) -> float:
    """Bytes the blocks ``first`` .. ``first + layers - 1`` hold, per microbatch."""

    policy, every = lay.activation_checkpoint, lay.activation_checkpoint_every
    # Blocks alike (their kind, recomputed or not) counted once: one trace each, whatever the depth.
    alike: dict[tuple, list[int]] = {}  # -> [a block of them, how many]
    for i in range(first, first + layers):
        lora, grad_in, adapted_from = _lora_of(model, args, lay, i)  # (LoRA: blocks differ by their adapters)
        key = (model.block_kind(args, i), policy if recomputed(i, policy, every) else "none", lora, grad_in,
               i < adapted_from)
        alike.setdefault(key, [i, 0])[1] += 1
    return sum(n * held_bytes(model, args, lay, batch, seq, kept, layer=i)
               for (_, kept, *_), (i, n) in alike.items())
