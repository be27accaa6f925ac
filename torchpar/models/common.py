"""What every model family gives the rest of torchpar: the model protocol and its adapter.

A model is single-device code. The parallel code and the planner know it only through

* the module itself: ``layers`` (an ``nn.ModuleDict`` of blocks keyed by global index, so a
  pipeline stage keeps its blocks' names), ``args`` (a frozen dataclass with at least ``dim``,
  ``n_layers``, ``n_heads``, ``vocab_size``, ``max_seq_len`` and ``tie_embeddings``),
  ``block_args(positions)`` (the extra positional inputs every block takes after the hidden
  states, for positions [b, s] or None = 0..s-1; a block's last input is what
  :func:`attention` takes: the documents' spans (packed for varlen attention on CUDA) or bias,
  or None = causal),
  ``forward(x, documents=None)`` (with each token's document index [b, s],
  attention stays inside documents: :func:`document_layout`; under context parallelism
  ``documents`` is a :class:`SequenceShard` instead, which the model passes on as it is),
  ``tie_weights()`` and ``init_weights()`` (:class:`SeededInit`); its forward skips top-level
  modules that a pipeline split set to ``None``;
* its :class:`ModelAdapter`: flavours, the tensor-parallel plan in words, which top-level
  modules belong to the first and to the last pipeline stage, every parameter's shape and TP
  split for the planner, and the counts (parameters, FLOPs per token).

Nothing here imports the distributed package: the TP plan is a table of style names that
``torchpar.parallel.tensor`` turns into DTensor styles.
"""

from __future__ import annotations

import functools
import inspect
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from torchpar.console import warn
from torchpar.models.lora import adapter_init, is_adapter

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # an older torch: document masking keeps the per-document calls everywhere
    varlen_attn = None
# torch 2.11's varlen_attn has no enable_gqa: grouped K/V heads are repeated to the query heads there.
VARLEN_GROUPS_HEADS = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters

# Tensor-parallel styles a plan may name (the words of the plan, not DTensor objects):
#   embedding  rows (vocabulary or positions) sharded; replicated ids in, the residual stream out
#   head       output projection, column-wise: residual stream in, vocab-sharded logits out
#   colwise    linear with its output features sharded (replicated input)
#   rowwise    linear with its input features sharded; partial sums reduced into the residual stream
#   norm       a norm over the residual stream: sequence-sharded under sequence parallelism
#   token_wise a module that works token by token on the residual stream (a prediction depth's join
#              and final norm): whole on every rank, on its own tokens under sequence parallelism
#   input      a sub-module whose first input is the residual stream, converted once to replicated
#              (one collective per sub-module instead of one per column-wise linear inside it)
#   head_norm  a norm over each attention head (q/k norms) of a rank's heads: its weight replicated,
#              its gradient summed over the tp ranks (each saw its own heads)
#   routed     a sub-module run whole on every tp rank (a mixture of experts: its router needs every
#              token's scores): replicated plain tensors in, its output converted back to the
#              residual stream's layout; it splits its experts' hidden width itself (expert_plan)
#   rowwise_replicated  a row-wise linear inside a routed module: partial sums all-reduced
#   whole_input  input, where every module inside that takes that input is run whole (replicated,
#              latent, shared): its gradient comes back already summed, so no backward collective
#   replicated  a module every tp rank runs whole on the replicated input (latent attention's down
#              projections): its weights replicated
#   latent     replicated, its output feeding column-wise projections (a latent's norm): the
#              output's gradient, a share from each rank's heads, summed over the tp ranks
#   shared     latent, its output a plain tensor every rank's heads use (the shared rotary key)
WHOLE_STYLES = ("replicated", "latent", "shared")  # modules every tp rank runs whole
TP_STYLES = ("embedding", "head", "colwise", "rowwise", "norm", "token_wise", "input", "head_norm", "routed",
             "rowwise_replicated", "whole_input", *WHOLE_STYLES)


# Model fields that change how the weights train, not what they are: a checkpoint resumes, and a
# weights file loads, under other values (DeepSeek-V3 lowered its prediction weight mid-run).
TRAINING_FIELDS = ("mtp_weight", "balance_coeff", "bias_rate", "capacity_factor")


def planned_under(plan: dict[str, str], word: str) -> tuple[str, ...]:
    """``"module."`` for every module a TP plan names ``word``: the names of what lies inside them
    start with one of these (``str.startswith`` of the tuple; none when the plan has no such module)."""
    return tuple(m + "." for m, w in plan.items() if w == word)


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model: wrapper segments (activation checkpointing,
    compile, FSDP) start with '_', model modules never do."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


# One causal kernel call per document skips the attention across documents that a mask only hides.
# On a CPU that wins at any count (8 x 512 tokens, 16 heads of 16: 3x faster than one masked call at
# 15 documents a row, 1.5x at 137); on a GPU without varlen attention (see _varlen_serves) each call
# is a few launches, so past this many documents per row on average one masked call over the whole
# window is made instead.
PER_DOCUMENT_MAX = 64


class DocumentSpans:
    """Where each row's documents lie: ``cuts[r]`` = (0, start of its second document, ..., s).
    Read only inside an eager function, so torch.compile neither guards on nor re-traces it."""

    __slots__ = ("cuts", "_ids")

    def __init__(self, cuts: tuple[tuple[int, ...], ...]):
        self.cuts = cuts
        self._ids: torch.Tensor | None = None

    def ids_on(self, device: torch.device) -> torch.Tensor:
        """[b, s]: each token's document, on ``device`` — made once per batch, not by every
        attention layer that reads it (a Python loop over the tokens, and a copy to the GPU)."""
        if self._ids is None or self._ids.device != torch.device(device):
            rows = [[i for i, (a, e) in enumerate(zip(cuts, cuts[1:])) for _ in range(e - a)]
                    for cuts in self.cuts]
            self._ids = torch.tensor(rows).to(device, non_blocking=True)  # (staged at once: small)
        return self._ids


class PackedDocuments(DocumentSpans):
    """The spans as varlen attention takes them: every document of every row one sequence of the
    packed b*s tokens. ``cu_seqlens`` [n + 1] int32 on the device: where each sequence starts, then
    b*s; ``max_len``: the longest. A compiled block reads both (a tensor input and an int), so it
    compiles twice, the second time dynamic in the number of documents and the longest, then
    takes new documents without tracing again."""

    __slots__ = ("cu_seqlens", "max_len")

    def __init__(self, cuts: tuple[tuple[int, ...], ...], cu_seqlens: torch.Tensor, max_len: int):
        super().__init__(cuts)
        self.cu_seqlens = cu_seqlens
        self.max_len = max_len


class SequenceShard(ABC):
    """A part of each sequence, as context parallelism hands it to the model in place of the
    document ids: ``positions`` [b or 1, s_local], each local token's position (in the window, or
    in its document), and :meth:`attend`, attention over the whole sequence. Made outside the
    model (torchpar.parallel.context), which passes it on to :func:`attention` as its mask."""

    positions: torch.Tensor

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None,
               window: int = 0) -> torch.Tensor:
        """Causal attention (inside documents, where there are) of the local queries over every
        rank's keys: q [b, h, s_local, hd], k and v [b, h_kv, s_local, hd] -> [b, h, s_local, hd];
        ``sinks`` and ``window`` as :func:`attention` takes them."""


# What a model's ``documents`` input and attention's mask may be (see document_layout, attention).
Documents = torch.Tensor | SequenceShard | None
Mask = DocumentSpans | torch.Tensor | SequenceShard | None


def varlen_layout(spans: DocumentSpans) -> tuple[torch.Tensor, int]:
    """The sequences of :func:`pack`'s layout: cu_seqlens [n + 1] int32 on the host (row r's
    document starting at c starts at r*s + c; then b*s) and the longest document."""
    s = spans.cuts[0][-1]
    starts = [r * s + c for r, cuts in enumerate(spans.cuts) for c in cuts[:-1]]
    longest = max(e - a for cuts in spans.cuts for a, e in zip(cuts, cuts[1:]))
    return torch.tensor([*starts, len(spans.cuts) * s], dtype=torch.int32), longest


def pack(x: torch.Tensor) -> torch.Tensor:
    """[b, h, s, hd] -> [b*s, h, hd], rows one after another. The projections' [b, s, h, hd]
    transposed, as the models pass them, come back to it as a view: no copy."""
    return x.transpose(1, 2).flatten(0, 1)


def unpack(x: torch.Tensor, b: int) -> torch.Tensor:
    """The inverse of :func:`pack`: [b*s, h, hd] -> [b, h, s, hd] (a view)."""
    return x.unflatten(0, (b, -1)).transpose(1, 2)


@functools.cache
def _varlen_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """The one place that picks how attention stays inside documents: varlen attention on CUDA,
    where it runs (one kernel for the whole batch, a custom op that compiles); else the per-document
    calls, measured and tuned on CPUs, and said once where a GPU gets them."""
    if device.type != "cuda":
        return False
    why = _varlen_fails(device, dtype)
    if why is not None:
        warn(f"document masking on {device} in {dtype}: varlen_attn {why}; attention runs one SDPA call "
             f"per document instead (past {PER_DOCUMENT_MAX} a row: one call with a dense mask), with many "
             f"small kernel launches and a graph break in every compiled block")
    return why is None


def _varlen_fails(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why varlen_attn cannot run on ``device`` in ``dtype`` (None: it runs). One tiny call with
    grouped query heads answers for this torch, GPU and dtype: the flash kernel takes fp16 and bf16
    only, on recent GPUs only, and older signatures lack window_size."""
    if varlen_attn is None:
        return "is not in this torch"
    q, kv = (torch.zeros(1, h, 2, 8, dtype=dtype, device=device) for h in (2, 1))  # [b, h, s, hd]
    cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
    try:
        _varlen(q, kv, kv, PackedDocuments((), cu, 2), gqa=True)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        return f"fails: {(str(e).splitlines() or [type(e).__name__])[0]}"
    return None


def document_layout(documents: torch.Tensor | SequenceShard, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, Mask]:
    """documents [b, s]: each token's document index, non-decreasing along a row (a packed window),
    best on the host (reading the spans from a device would wait for it). Returns each token's
    position inside its document [b, s] on ``device`` and what :func:`attention` takes to keep
    attention inside documents: on CUDA the spans packed for varlen attention
    (:class:`PackedDocuments`); elsewhere the spans, or with many short documents the additive bias
    [b, 1, s, s] (0 = may attend, -inf = not) made once per forward in the compute dtype.
    A :class:`SequenceShard` gives its positions and serves attention itself."""
    if isinstance(documents, SequenceShard):
        return documents.positions, documents
    b, s = documents.shape
    idx = torch.arange(s, device=documents.device).expand(b, s)
    starts_here = torch.ones_like(documents, dtype=torch.bool)
    starts_here[:, 1:] = documents[:, 1:] != documents[:, :-1]
    starts = torch.where(starts_here, idx, torch.zeros_like(idx)).cummax(dim=1).values  # [b, s]
    positions = (idx - starts).to(device, non_blocking=True)
    starts_here = starts_here.cpu()
    if _varlen_serves(device, dtype):
        spans = _spans(starts_here)
        cu_seqlens, longest = varlen_layout(spans)
        # Made here, in the eager forward, so a compiled block takes it as an input. non_blocking:
        # a copy this small is staged at once, with no wait for the GPU's queue.
        return positions, PackedDocuments(spans.cuts, cu_seqlens.to(device, non_blocking=True), longest)
    if int(starts_here.sum()) <= PER_DOCUMENT_MAX * b:
        return positions, _spans(starts_here)
    documents = documents.to(device, non_blocking=True)
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    keep = (documents.unsqueeze(2) == documents.unsqueeze(1)) & causal  # [b, s, s]
    bias = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
    return positions, bias.unsqueeze(1)


def _spans(starts_here: torch.Tensor) -> DocumentSpans:
    """starts_here [b, s] bool on the host: where each document starts (column 0 always)."""
    s = starts_here.shape[1]
    return DocumentSpans(tuple((*row.nonzero().flatten().tolist(), s) for row in starts_here))


def repeat_kv(k: torch.Tensor, v: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [b, h_kv, s, hd] repeated to the query heads [b, h_kv x groups, s, hd] (each KV head
    ``groups`` times, in order), for a kernel that takes no grouped heads."""
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds where parallel code split it (a DTensor's differentiable
    ``to_local()``), else ``t`` itself: for model code that combines a split parameter with this
    rank's activations, such as a per-head vector (tensor parallelism's word ``heads``) with this
    rank's heads. Read by duck typing, so model code stays free of the distributed package."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask = None,
              sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal self-attention: q [b, h, s, hd], k [b, h_kv, s, hd] and v [b, h_kv, s, vd] (h_kv divides
    h: grouped query heads; vd <= hd) -> [b, h, s, vd]. mask: None = causal over the window; the
    spans or the bias of :func:`document_layout` = causal inside each document; a
    :class:`SequenceShard` = over the whole sequence, of which q, k and v are this rank's part.
    sinks [h]: each head's extra logit in its softmax (see :func:`_with_sinks`). window > 0: a
    sliding window, each query sees itself and the ``window - 1`` keys before it (inside its
    document)."""
    if isinstance(mask, SequenceShard):
        return mask.attend(q, k, v, sinks, window)
    if v.shape[-1] < q.shape[-1]:
        return with_values_as_wide(lambda q, k, v: attention(q, k, v, mask, sinks, window), q, k, v)
    if sinks is not None:
        return _with_sinks(q, k, v, mask, sinks, window)
    gqa = q.shape[1] != k.shape[1]
    if window and mask is None and _varlen_serves(q.device, q.dtype):
        mask = _whole_rows(q.shape[0], q.shape[2], q.device)  # (the kernel that takes a window)
    if isinstance(mask, PackedDocuments):
        return _varlen(q, k, v, mask, gqa, window)
    if window:  # (no fused kernel here takes a window: the visible keys as a mask)
        mask = _visible(mask, q.shape[2], q.device, window)
    elif isinstance(mask, DocumentSpans):
        return _per_document(q, k, v, mask, gqa)
    if gqa and mask is not None:
        # CUDA's kernels that take a mask do not group heads; the one left would build the
        # [b, h, s, s] scores. A repeated copy of K and V is cheaper.
        k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


def with_values_as_wide(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``attend(q, k, v)`` for value heads narrower than the query's (latent attention): the fused
    kernels (flash on CPU and CUDA, varlen, the ring's) take one width for q, k and v, so zero
    columns widen v, and the output's own columns are its first ones (the rest are zero)."""
    width = v.shape[-1]
    return attend(q, k, F.pad(v, (0, q.shape[-1] - width)))[..., :width]


@functools.cache
def _whole_rows(b: int, s: int, device: torch.device) -> PackedDocuments:
    """Each row of a [b, s] batch as one document, for varlen attention's sliding window."""
    spans = DocumentSpans(((0, s),) * b)
    cu_seqlens, _ = varlen_layout(spans)
    return PackedDocuments(spans.cuts, cu_seqlens.to(device), s)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocuments,
            gqa: bool, window: int = 0) -> torch.Tensor:
    # One kernel over every document of the batch, none across two; window (-1, 0) = causal,
    # (w - 1, 0) = each query and the w - 1 keys before it.
    grouped = {"enable_gqa": gqa} if VARLEN_GROUPS_HEADS else {}
    if gqa and not VARLEN_GROUPS_HEADS:
        k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
    out = varlen_attn(pack(q), pack(k), pack(v), docs.cu_seqlens, docs.cu_seqlens, docs.max_len,
                      docs.max_len, window_size=(window - 1 if window else -1, 0), **grouped)  # [b*s, h, hd]
    return unpack(out, q.shape[0])  # [b, h, s, hd]


def _with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                sinks: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Attention whose softmax over a query's keys has one more logit, its head's sink: it takes a
    share of the probability and brings no value, so a head may attend to (almost) nothing. No
    fused kernel takes it, so the scores are written out, [b, h, s, s] in fp32."""
    b, h, s, hd = q.shape
    k, v = repeat_kv(k, v, h // k.shape[1])
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * hd ** -0.5  # [b, h, s, s]
    scores = scores.masked_fill(~_visible(mask, s, q.device, window), float("-inf"))
    sink = sinks.float().view(1, h, 1, 1).expand(b, h, s, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s]  # (the sink's share dropped)
    return torch.matmul(probs.to(v.dtype), v)  # [b, h, s, hd]


@torch.compiler.disable  # (spans: host tuples, new every batch)
def _visible(mask: Mask, s: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """[b or 1, 1, s, s] bool: the keys each query sees (causal, inside its document, and with a
    window the ``window - 1`` before it)."""
    seen = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    if window:
        seen = seen.triu(1 - window)
    if mask is None:
        return seen.view(1, 1, s, s)
    if isinstance(mask, DocumentSpans):
        docs = mask.ids_on(device)  # [b, s]
        return ((docs.unsqueeze(2) == docs.unsqueeze(1)) & seen).unsqueeze(1)
    return (mask == 0) & seen  # (the additive bias: 0 where a key is seen, -inf elsewhere)


@torch.compiler.disable  # new spans every batch: run eagerly between a compiled block's graphs
def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: DocumentSpans,
                  gqa: bool) -> torch.Tensor:
    # Contiguous [h, s, hd] rows: a document's slice of the transposed projections would be strided
    # token by token, which the CPU kernel reads about twice as slowly. unbind/split (not indexing):
    # their backward is one stack/cat, where slicing would zero-fill a whole row per document.
    q, k, v = (t.contiguous() for t in (q, k, v))
    rows = []
    for qr, kr, vr, cuts in zip(q.unbind(0), k.unbind(0), v.unbind(0), spans.cuts):  # [h, s, hd]
        sizes = [e - a for a, e in zip(cuts, cuts[1:])]
        parts = [F.scaled_dot_product_attention(qd.unsqueeze(0), kd.unsqueeze(0), vd.unsqueeze(0),
                                                is_causal=True, enable_gqa=gqa).squeeze(0)
                 for qd, kd, vd in zip(qr.split(sizes, 1), kr.split(sizes, 1), vr.split(sizes, 1))]
        rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    return torch.stack(rows)  # [b, h, s, hd]


class SwiGLU(nn.Module):
    """The gated MLP of Llama-style blocks (and a mixture of experts' shared experts):
    w2(silu(w1 x) * w3 x), hidden width ``hidden``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SeededInit(nn.Module):
    """Deterministic initialization from ``(seed, canonical parameter name)`` alone, so any split
    or sharding of the model starts from exactly the numbers of the whole model. A model says
    per parameter what it starts as — ``init_std(name)``: the std of a normal init, or
    ``"ones"`` / ``"zeros"`` — and rebuilds its buffers in :meth:`reset_buffers`."""

    def reset_buffers(self, device: torch.device | None) -> None:
        """Recompute non-persistent buffers (e.g. RoPE tables) on ``device``."""

    def initial_value(self, name: str, shape: tuple[int, ...], seed: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
        """The full tensor, made on ``device`` by that device's generator: the same numbers for
        every layout on one kind of device (a GPU's differ from a CPU's), and no CPU thread
        generating a large model's weights one after another."""
        std = adapter_init(name, shape)  # (a LoRA adapter's: the same for every model)
        if std is None:
            std = self.init_std(name)
        if std == "ones":
            return torch.ones(shape, device=device)
        if std == "zeros":
            return torch.zeros(shape, device=device)
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen, device=device).mul_(std)

    @torch.no_grad()
    def initial_values(self, seed: int, local_part=None, device: torch.device | None = None,
                       values: dict[str, torch.Tensor] | None = None):
        """(parameter, destination, value) for each parameter in turn, each value made only when
        its turn comes (so a caller can place it and drop it before the next exists).

        ``local_part(param, full) -> (dst, src)`` lets parallel code map the full value onto the
        piece of a sharded parameter this process holds; by default the whole tensor.
        ``values`` (by canonical name: full tensors, or lazy weights with ``read(index)`` that read
        only the part asked for) replaces the random init (of all but LoRA's adapters, which a base
        model's weights do not hold). ``device``: where values are made
        (default: each parameter's own).
        """
        for name, p in self.named_parameters():
            name = canonical_name(name)
            full = (values[name] if values is not None and not (is_adapter(name) and name not in values)
                    else self.initial_value(name, tuple(p.shape), seed, device or p.device))
            if local_part is not None:
                dst, src = local_part(p, full)
            else:
                dst, src = p, full.read() if hasattr(full, "read") else full
            yield p, dst, src
            del full, dst, src  # before the next value is made

    @torch.no_grad()
    def init_weights(self, seed: int, local_part=None, buffer_device: torch.device | None = None,
                     values: dict[str, torch.Tensor] | None = None) -> None:
        """Fill every parameter (see :meth:`initial_values`) and rebuild the buffers."""
        for _, dst, src in self.initial_values(seed, local_part, buffer_device, values):
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        self.reset_buffers(buffer_device)


@dataclass(frozen=True)
class StackRow:
    """How an HF tensor holds a piece of a torchpar one: row ``index`` of a stack. An expert's
    matrix of a stack [experts, a, b], transposed ([b, a]: HF keeps each expert's linears apart,
    as [out, in]); or, not transposed, one block's vector of a stack [blocks, n] (a router's bias)."""
    index: int
    transposed: bool = True


@dataclass(frozen=True)
class Copy:
    """How an HF tensor repeats a torchpar one that another HF tensor already holds (DeepSeek-V3's
    prediction layers keep copies of the embedding and the head): written on export, not read."""


@dataclass(frozen=True)
class Interleaved:
    """How an HF tensor holds a torchpar one: as every other entry of its last dimension, from
    ``part`` (0 or 1), another torchpar tensor's between (gpt-oss's gate_up_proj: gate, up, gate,
    up, ...)."""
    part: int


@dataclass(frozen=True)
class RowsOf:
    """How an HF tensor holds a torchpar one: as its rows from ``start`` on, beside other torchpar
    tensors' rows (HF fuses projections torchpar keeps apart)."""
    start: int


class ModelAdapter(ABC):
    """One model family as the trainer, the parallel code and the planner see it. Subclasses set
    the class attributes and implement the shape methods; see ``models/llama.py``."""

    name: str  # the family, ``[model] name``
    model_class: type  # built as model_class(args)
    args_class: type  # the frozen dataclass of the model's shape
    flavors: dict  # flavour name -> args
    first_stage: tuple[str, ...]  # top-level modules only the first pipeline stage keeps
    last_stage: tuple[str, ...]  # ... and only the last
    top_plan: dict[str, str]  # top-level module -> TP style
    block_plan: dict[str, str]  # module inside a block -> TP style

    # Hugging Face transformers' class for this family (config.json "architectures"), or None
    # when the family has no HF mapping (then export/import in HF format is refused).
    hf_architecture: str | None = None

    def layer_plan(self, args, layer: int) -> dict[str, str]:
        """The TP plan of block ``layer`` (blocks may differ: a dense block before routed ones)."""
        return self.block_plan

    # Modules inside a block that hold stacked experts ([experts, ...] weights): their name -> each
    # weight's name -> the dimension tensor parallelism splits (the hidden width). The module's
    # ``run(x, counts, *weights)`` computes its rows (sorted by expert) with the pieces it is given.
    expert_plan: dict[str, dict[str, int]] = {}

    def experts(self, args) -> int:
        """Routed experts per block, which expert parallelism splits over ranks (0: a dense model)."""
        return 0

    def stack_shape(self, args, name: str) -> tuple[int, int, int] | None:
        """The whole shape [experts, rows, cols] of the stacked weight ``name`` (block-relative, one of
        :attr:`expert_plan`'s), which the planner's (rows, cols) entries flatten; None for others."""
        return None

    def run_notes(self, args, layout, device: torch.device) -> list[str]:
        """Lines for the start-up message: how this family's parts run in ``layout`` (none by default)."""
        return []

    def expert_slots(self, args) -> int:
        """Experts each token is sent to (top k): rows per token an expert-parallel layer moves."""
        return 0

    def auxiliary_terms(self, args) -> tuple[str, ...]:
        """Names of the auxiliary losses the model adds with ``torchpar.loss.add_auxiliary_loss``
        (a mixture of experts' balance loss): every rank logs these, in this order. None by default."""
        return ()

    # -- args and building

    def args(self, flavor: str, n_layers: int = 0, **shape):
        """The flavour's args with the given shape fields replaced (0 or None = keep the flavour's;
        True and False both replace it); a field this family does not have, or a shape it cannot
        build, raises ValueError."""
        args = self.flavors[flavor]
        changes = {k: v for k, v in {"n_layers": n_layers, **shape}.items()
                   if v is not None and (isinstance(v, bool) or v != 0)}
        unknown = sorted(set(changes) - {f.name for f in fields(args)})
        if unknown:
            keep = "leave it unset" if isinstance(changes[unknown[0]], bool) else "leave it at 0"
            raise ValueError(f"model.{unknown[0]} does not apply to the {self.name} family; {keep}")
        args = replace(args, **changes)
        self.check_shape(args)
        return args

    def check_shape(self, args) -> None:
        """ValueError naming the field when ``args`` cannot build a model."""
        own = getattr(args, "head_size", 0)  # (a head size set apart from dim / heads)
        if args.dim % args.n_heads and not own:
            raise ValueError(f"model.dim = {args.dim} is not a multiple of model.n_heads = {args.n_heads}")
        if args.n_heads % args.n_kv_heads:
            raise ValueError(f"model.n_heads = {args.n_heads} is not a multiple of model.n_kv_heads = "
                             f"{args.n_kv_heads}")
        head = own or args.dim // args.n_heads
        if head % 2 and hasattr(args, "rope_theta"):
            raise ValueError(f"RoPE needs an even head size; the flavour's head size (or model.dim / "
                             f"model.n_heads) is {head}")

    def build(self, args) -> nn.Module:
        return self.model_class(args)

    # -- Hugging Face format (families with hf_architecture)

    def hf_config(self, args) -> dict:
        """config.json fields that determine the model's math."""
        raise TypeError(f"the {self.name} family has no Hugging Face mapping")

    def hf_problem(self, args) -> str | None:
        """Why these args have no Hugging Face form (None: they have one)."""
        return None if self.hf_architecture else f"the {self.name} family has no Hugging Face mapping"

    def hf_unlike(self, args, checks, what: str) -> str | None:
        """The one line naming every field whose check (``(field, holds)`` pairs) fails, with what
        the HF class is (``what``), or None when all hold."""
        unlike = [f"{field} = {getattr(args, field)!r}" for field, holds in checks if not holds]
        if not unlike:
            return None
        return (f"this {self.name} flavour ({', '.join(unlike)}) has no Hugging Face form: "
                f"{self.hf_architecture} {what}")

    def hf_tensors(self, args) -> list[tuple[str, str, object]]:
        """(torchpar name, HF name, how) per HF tensor or part of one: ``how`` is None (the same
        tensor), the number of heads whose rows are RoPE-permuted, a :class:`StackRow` (one torchpar
        stack gives several HF tensors) or :class:`RowsOf` (several torchpar tensors give one HF
        tensor, listed in order); a tied head is listed once, under the embedding. Names may include
        :meth:`extra_state`'s."""
        raise TypeError(f"the {self.name} family has no Hugging Face mapping")

    def extra_state(self, args) -> dict[str, tuple[int, ...]]:
        """Tensors the trainer keeps beside the model's parameters that change what it computes, by
        their name in a checkpoint, with their shapes (a mixture of experts' ``routing.expert_bias``:
        every MoE block's balancing bias); exports and imports carry them."""
        return {}

    def to_hf(self, t, how):
        """A torchpar tensor as HF holds it (see :meth:`hf_tensors`; identity when ``how`` is None;
        a :class:`RowsOf` part as it is, its rows placed by hf.py)."""
        if isinstance(how, StackRow):
            return t[how.index].t() if how.transposed else t[how.index]
        return t

    def from_hf(self, t, how):
        """The inverse of :meth:`to_hf` for row-permuted heads (stack rows are read by hf.py)."""
        return t

    @staticmethod
    def hf_shape(shape: tuple[int, ...], how) -> tuple[int, ...]:
        """The shape of the HF tensor (of its part, for :class:`RowsOf`) a torchpar one of
        ``shape`` gives (see :meth:`hf_tensors`)."""
        if isinstance(how, StackRow):
            return (shape[2], shape[1]) if how.transposed else shape[1:]
        if isinstance(how, Interleaved):
            return (*shape[:-1], 2 * shape[-1])
        return shape

    # -- tensor parallelism

    def sequence_terms(self, args) -> tuple[str, ...]:
        """The model fields (set here) whose terms are computed over each whole sequence, which
        context parallelism splits (a fact the composition table reads)."""
        return ()

    def custom_attention(self, args) -> tuple[str, ...]:
        """The model fields (set here) that make attention more than causal softmax attention (an
        attention sink's extra logit, a sliding window): the ring's kernels compute none of it,
        all-to-all context parallelism hands them to the model's own attention (a fact the
        composition table reads)."""
        return ()

    @abstractmethod
    def tp_divisors(self, args) -> dict[str, int]:
        """Sizes the tensor-parallel degree must divide, by what they are."""

    # -- shapes for the planner

    @abstractmethod
    def stage_params(
        self, args, first: bool, last: bool, layers: range
    ) -> list[tuple[str, tuple[int, int], int | None]]:
        """(name, 2-D shape, TP-sharded dim or None) of every parameter of one pipeline stage
        holding blocks ``layers`` (global indices), in model order (first-stage modules, blocks —
        on the last stage the prediction depths' after them —, last-stage modules); vectors are
        (n, 1), a stack of experts' matrices (experts, rest) (its first dim the one FSDP shards).
        A tied head is left out when the embedding is on the same stage."""

    def block_params(self, args, layer: int | None = None) -> list[tuple[str, tuple[int, int], int | None]]:
        """Block ``layer``'s entries of :meth:`stage_params`; None = the largest block."""
        last = args.n_layers - 1 if layer is None else layer
        return self.stage_params(args, False, False, range(last, last + 1))

    def block_kind(self, args, layer: int):
        """What makes block ``layer`` hold other activations than another (a hashable; blocks of
        one kind hold the same bytes): none by default."""
        return 0

    def traced_args(self, args, kind=None, tp: int = 1):
        """The one-block model whose activations the planner measures for the blocks of ``kind``
        (:meth:`block_kind`; None: the largest kind, where blocks differ), on a rank of tensor
        parallelism of degree ``tp`` where a module splits itself rather than by its plan word (a
        mixture of experts' hidden width: its model is traced with the rank's share)."""
        return replace(args, n_layers=1)

    def depth_blocks(self, args) -> range:
        """The indices of the prediction depths' blocks (:meth:`prediction_depths`), after the
        model's own."""
        return range(args.n_layers, args.n_layers + self.prediction_depths(args))

    def blocks_alone(self, args, blocks: int):
        """``args`` cut to ``blocks`` of the model's own blocks and nothing past them (no prediction
        depths): the model the planner's probe times, whose forward runs every block it builds."""
        return replace(args, n_layers=blocks)

    def prediction_depths(self, args) -> int:
        """Blocks the model holds past its own ``n_layers`` (indices from there on), on the last
        pipeline stage, each running the head again in training: multi-token prediction's depths.
        None by default."""
        return 0

    def routing(self, parts: list[nn.Module], args):
        """What the trainer updates and logs after each step for the model's routers (a mixture of
        experts' balancing bias and loads: :class:`torchpar.models.moe.Routing`), or None."""
        return None

    def routed_counts(self, args) -> int:
        """How many values :meth:`routing`'s loads add to each step's all-reduce over the world."""
        return 0

    # -- counts

    @abstractmethod
    def param_counts(self, args) -> dict[str, int]:
        """Parameters per part: at least ``embedding`` (everything of the first stage),
        ``layer`` (one block), ``layers``, ``norm`` and ``output`` (the rest of the last stage;
        0 for a tied head); ``depths``, where a model has more than these (multi-token
        prediction's)."""

    def num_params(self, args) -> int:
        c = self.param_counts(args)
        return c["embedding"] + c["layers"] + c["norm"] + c["output"] + c.get("depths", 0)

    @abstractmethod
    def matmul_params(self, args) -> tuple[int, int]:
        """Weights that multiply activations: (per block, in the head). Lookups and vectors do not."""

    def flops_per_token(self, args, seq_len: int) -> int:
        """Training FLOPs per token: 3 x forward (backward = 2 x forward). Forward = 2 FLOPs per
        multiply-accumulate of every matmul weight (the head's too, tied or not) + attention
        scores and values, 2 x s x (heads x (query width + value width)) per layer over the full
        s x s square (PaLM's 2 x 2 x s x d with heads d wide; causal masking ignored; see
        :meth:`attention_keys`)."""
        return 3 * (2 * self.matmul_weights(args)
                    + 2 * self.attention_keys(args, seq_len) * self.attention_width(args))

    def matmul_weights(self, args) -> int:
        """The matmul weights a token's forward passes through: every block's and the head's."""
        block, head = self.matmul_params(args)
        return block * args.n_layers + head

    def blocks_matmul(self, args) -> int:
        """The matmul weights a token passes through in the model's own blocks."""
        return self.matmul_params(args)[0] * args.n_layers

    def attention_heads(self, args) -> tuple[int, int, int, int]:
        """(query heads, key/value heads, a query or key head's width, a value head's width)."""
        return args.n_heads, args.n_kv_heads, args.dim // args.n_heads, args.dim // args.n_heads

    def attention_width(self, args) -> int:
        """Multiply-adds per query and key, over all heads: its score (a query head's width) and
        its share of the output (a value head's width)."""
        heads, _, qk, v = self.attention_heads(args)
        return heads * (qk + v)

    def attention_keys(self, args, seq_len: int) -> int:
        """The keys a query's attention is counted over, summed over the layers: the whole
        sequence in each (the full square, as FLOPs per token count it)."""
        return seq_len * args.n_layers
