"""LoRA: low-rank adapters on a model's linear layers, the rest of the model frozen.

An adapted layer ``W`` [out, in] keeps its weight (now frozen) and gains two trainable matrices,
``lora_a`` [r, in] and ``lora_b`` [out, r]; its output becomes

    y = x W^T (+ bias) + (alpha / r) * dropout(x) A^T B^T

``A`` starts random (normal, std 1/sqrt(in)) and ``B`` at zero, so training starts from the base
model exactly. The adapters are parameters of the layer itself (``layers.0.attention.wq.lora_a``)
and the extra term is a forward hook, so the layer stays the module it was — an ``nn.Linear``, or
torchao's ``Float8Linear`` under FP8 (its matmul in FP8, the adapters' in the compute dtype) — and
the tensor-parallel plans, the ZeRO engines, the checkpoints and the Hugging Face mapping see the
names they know. Parallelism is applied from outside: tensor parallelism splits ``B`` with a
column-wise weight's output and ``A`` with a row-wise weight's input (``parallel/tensor.py``).

Merging folds the adapters into the weight, ``W + (alpha / r) B A``: the model a merged export
holds, equal to the adapted one up to rounding.
"""

from __future__ import annotations

import functools
import threading
import types
from fnmatch import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

A, B = "lora_a", "lora_b"  # the adapters' parameter names on an adapted layer


def is_adapter(name: str) -> bool:
    """Whether a (canonical) parameter name is one of LoRA's."""
    return name.rpartition(".")[2] in (A, B)


def adapter_init(name: str, shape: tuple[int, ...]) -> float | str | None:
    """How an adapter starts, in ``SeededInit.init_std``'s words (the std of a normal init, or
    "zeros"); None for a parameter that is no adapter. ``B`` = 0: the adapted model starts as the
    base; ``A``'s std 1/sqrt(in) keeps ``x A^T`` near unit scale, so ``B``'s first gradients are."""
    leaf = name.rpartition(".")[2]
    if leaf == A:
        return shape[1] ** -0.5
    if leaf == B:
        return "zeros"
    return None


def scale(lora) -> float:
    """The adapters' product is multiplied by alpha / r ([lora] ``lora``)."""
    return lora.alpha / lora.rank


def targets(module: nn.Module, model, lora) -> list[tuple[str, nn.Linear]]:
    """The linear layers of ``module`` (of adapter ``model``) that [lora] ``lora`` adapts: named by a
    pattern of ``modules`` and none of ``exclude``; never the embedding or the output head (the
    adapter's first_stage and last_stage modules), which stay whole and frozen."""
    keep_out = (*model.first_stage, *model.last_stage)
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[0] not in keep_out
            and any(fnmatch(name, p) for p in lora.modules)
            and not any(fnmatch(name, p) for p in lora.exclude)]


class _Flag(threading.local):  # (per thread: autograd may recompute on another)
    on = False  # (a class default, so that every thread reads one without a getattr default)


_LOW_RANK = _Flag()


def in_low_rank() -> bool:
    """Whether the op running now belongs to an adapter's low-rank term — cheap to compute again
    (r multiply-adds an output element), as wide as the layer's output to keep: selective
    recomputation recomputes these rather than keep them as it keeps the layers' matmuls."""
    return _LOW_RANK.on


def _adapted(layer: nn.Linear, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    """The forward hook of an adapted layer: its output plus the scaled low-rank term."""
    x = F.dropout(inputs[0], layer.lora_dropout, layer.training) if layer.lora_dropout else inputs[0]
    if torch.compiler.is_compiling():
        # (a compiled block traces no flag — a write to it would break the graph — and keeps the
        # low-rank products with the matmuls' under selective recomputation)
        return out + F.linear(F.linear(x, layer.lora_a), layer.lora_b) * layer.lora_scale
    _LOW_RANK.on = True
    try:
        low_rank = F.linear(F.linear(x, layer.lora_a), layer.lora_b) * layer.lora_scale
    finally:
        _LOW_RANK.on = False
    return out + low_rank


def add_adapters(module: nn.Module, model, lora) -> None:
    """Adapt the layers :func:`targets` names, in place (on the meta model, before any parallelism);
    :func:`freeze_base` freezes the rest once the parallel styles have made their parameters."""
    for _, layer in targets(module, model, lora):
        w = layer.weight
        layer.register_parameter(A, nn.Parameter(torch.empty(lora.rank, w.shape[1], device=w.device)))
        layer.register_parameter(B, nn.Parameter(torch.empty(w.shape[0], lora.rank, device=w.device)))
        layer.lora_scale, layer.lora_dropout = scale(lora), lora.dropout
        layer.register_forward_hook(_adapted)


def freeze_base(module: nn.Module) -> None:
    """Every parameter but the adapters stops requiring gradients. (Called after tensor
    parallelism: some of torch's styles make new parameters that forget ``requires_grad``.)"""
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter(name))


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, factor: float) -> torch.Tensor:
    """``weight + factor * b @ a`` in fp32: a layer with the adapters folded in, in the wider of the
    weight's and the adapters' dtypes (a base held in bf16 would round a small update away; an
    export casts to the dtype it is asked for)."""
    dtype = torch.promote_types(weight.dtype, a.dtype)
    return (weight.float() + factor * (b.float() @ a.float())).to(dtype)


def merge_weights(weights: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """Full weights by canonical name with every adapted layer's adapters merged into its weight
    and left out: the plain model's weights."""
    out = {k: v for k, v in weights.items() if not is_adapter(k)}
    for name in weights:
        if name.endswith("." + A):
            layer = name[: -len(A) - 1]
            out[f"{layer}.weight"] = merged(weights[f"{layer}.weight"], weights[name],
                                            weights[f"{layer}.{B}"], factor)
    return out


def spec(lora) -> tuple | None:
    """What of [lora] ``lora`` fixes the adapters' shapes, hashable (None: LoRA off)."""
    return (lora.rank, tuple(lora.modules), tuple(lora.exclude)) if lora is not None and lora.rank else None


@functools.lru_cache(maxsize=32)
def adapted_layers(model, args, lora_spec: tuple) -> dict[str, tuple[int, int]]:
    """(out, in) features of each layer LoRA adapts in a model of adapter ``model`` with ``args``,
    by name, for :func:`spec` ``lora_spec`` (one meta model per job, which the planner reads)."""
    rank, modules, exclude = lora_spec
    with torch.device("meta"):
        module = model.build(args)
    lora = types.SimpleNamespace(rank=rank, modules=modules, exclude=exclude)
    return {name: (m.out_features, m.in_features) for name, m in targets(module, model, lora)}


def first_adapted(model, args, lora_spec: tuple | None) -> tuple[int, str | None]:
    """The block of the first layer holding an adapter (spec ``lora_spec``), in the model's order,
    and its module (the block's top-level one: ``attention``, ``feed_forward``); (0, None) without
    LoRA, where every block is trained."""
    if lora_spec is None:
        return 0, None
    _, block, module = next(iter(adapted_layers(model, args, lora_spec))).split(".")[:3]
    return int(block), module


def first_adapted_block(model, args, lora_spec: tuple | None) -> int:
    """The first block holding an adapter (0 without LoRA): the blocks before it run no backward,
    nor recompute, and a pipeline stage of them alone gets no gradient back."""
    return first_adapted(model, args, lora_spec)[0]


def adapted_in(model, args, lora_spec: tuple, layer: int) -> tuple[str, ...]:
    """The layers LoRA adapts in block ``layer``, by name in the block (``attention.wq``)."""
    prefix = f"layers.{layer}."
    return tuple(name.removeprefix(prefix) for name in adapted_layers(model, args, lora_spec)
                 if name.startswith(prefix))


def _forward_alone(model, args, lora_spec: tuple) -> tuple[int, str | None, tuple[str, ...]]:
    """Where training starts: the first adapted layer's block (every block of the model's own, for
    a prediction depth's layer) and module, and the block's modules that run before that one (in
    the order the block runs them), which run forward alone like the blocks before."""
    block, module = first_adapted(model, args, lora_spec)
    if block >= args.n_layers:
        return args.n_layers, None, ()
    if module is None:
        return block, None, ()
    tops = list(dict.fromkeys(name.split(".")[0] for name, _, _ in model.block_params(args, block)))
    return block, module, tuple(tops[:tops.index(module)])


def matmul_flops(model, args, lora_spec: tuple | None):
    """``flops(weight name)``: training FLOPs per weight element and token of a frozen-or-trained
    layer's products, by canonical weight name (``layers.3.attention.wq.weight``): 6 trained
    (forward, input and weight gradients); with LoRA 4 for the frozen base (no weight gradient),
    2 where it runs before the first adapted layer (forward alone). The planner's FP8 share."""
    if lora_spec is None:
        return lambda name: 6
    block, _, frozen = _forward_alone(model, args, lora_spec)

    def flops(name: str) -> int:
        parts = name.split(".")
        if parts[0] != "layers" or len(parts) < 3:
            return 4
        layer = int(parts[1])
        return 2 if layer < block or (layer == block and parts[2] in frozen) else 4

    return flops


def flops_per_token(model, args, seq_len: int, lora_spec: tuple | None) -> int:
    """Training FLOPs per token of a model of adapter ``model`` (``model.flops_per_token``), with
    LoRA (``lora_spec``, :func:`spec`): frozen weights get no weight gradient, so their matmuls
    cost 2 x forward instead of 3 x; each adapter's two small matmuls cost 3 x forward. What runs
    before the first adapted layer — the blocks before its block, and that block's modules before
    its module (its attention, where the feed-forward layers alone are adapted) — runs no backward
    at all (nothing before it is trained): forward alone. (The layers that read the first adapted
    module's frozen input skip their input's gradient too; that is still counted.)"""
    full = model.flops_per_token(args, seq_len)
    if lora_spec is None:
        return full
    adapted = adapted_layers(model, args, lora_spec)
    adapters = sum(lora_spec[0] * (n + k) for n, k in adapted.values())
    trained = full - 2 * model.matmul_weights(args) + 6 * adapters
    block, module, frozen = _forward_alone(model, args, lora_spec)
    before = model.blocks_alone(args, block)
    weights = model.blocks_matmul(before) if block else 0
    keys = model.attention_keys(before, seq_len) if block else 0
    if module is not None:
        entries = model.block_params(args, block)
        tops = list(dict.fromkeys(name.split(".")[0] for name, _, _ in entries))
        weights += sum(r * c for name, (r, c), _ in entries if name.split(".")[0] in frozen and c > 1)
        matmuls = [top for top in tops if any(n.split(".")[0] == top and c > 1 for n, (_, c), _ in entries)]
        if matmuls[0] in frozen:  # (a block's first module of matmuls is its attention, in every family)
            keys = model.attention_keys(model.blocks_alone(args, block + 1), seq_len)
    forward = 2 * weights + 2 * keys * model.attention_width(args)
    return trained - 2 * forward + 2 * weights


def with_adapters(entries: list, layer: int, adapted: dict, rank: int) -> list:
    """Block ``layer``'s parameter entries (the adapter's ``block_params``: name, (rows, cols),
    TP-split dimension) with each adapted layer's A and B after its own (its weight, then its bias),
    as the layer registers them: A (r, in) split over tp with a row-wise weight's columns, B
    (out, r) with a column-wise weight's rows."""
    out, weights = [], {}
    for i, (name, shape, tp_dim) in enumerate(entries):
        out.append((name, shape, tp_dim))
        module, _, leaf = name.rpartition(".")
        if leaf == "weight":
            weights[module] = shape, tp_dim
        after = entries[i + 1][0].rpartition(".")[0] if i + 1 < len(entries) else None
        if module in weights and after != module and f"layers.{layer}.{module}" in adapted:
            (rows, cols), split = weights[module]
            out += [(f"{module}.{A}", (rank, cols), 1 if split == 1 else None),
                    (f"{module}.{B}", (rows, rank), 0 if split == 0 else None)]
    return out

