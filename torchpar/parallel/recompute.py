"""Activation recomputation, applied block by block from outside the model.

``full``: a block keeps only its input and recomputes everything in backward (every k-th block
with ``every = k``; the others keep all they save). ``selective``: torch's selective
checkpointing; the outputs of matmuls, of attention and of reductions (tensor parallelism's
all-reduce and reduce-scatter, which follow a matmul on the critical path) are kept, and the cheap
elementwise work between them (norms, RoPE, activation functions, residual adds) is recomputed, as
are LoRA's low-rank products (r multiply-adds an element, each as wide as its layer's output) —
most of full recomputation's saving, little of its cost. Sequence parallelism's all-gathers run
again in backward: keeping them would hold each norm's output at full length; so do context
parallelism's exchanges around attention, which would hold q, k, v and the output twice.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from torchpar.models.lora import in_low_rank

# What selective recomputation keeps rather than recomputes (aten and functional-collective
# overloads; looked up by name, so one missing from a torch build is simply absent).
KEPT_OPS = (
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten._grouped_mm.default",  # a mixture of experts' matmuls, all its experts in one
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "torch_attn._varlen_attn.default",  # document masking on CUDA (registered by torch.nn.attention.varlen)
    "torchpar.ring_attention.default",  # context parallelism's ring (registered by torchpar.parallel.context)
    "_c10d_functional.all_reduce.default", "_c10d_functional.reduce_scatter_tensor.default",
)


@functools.cache
def kept_ops() -> frozenset:
    found = set()
    for name in KEPT_OPS:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    # (LoRA's low-rank products are recomputed: r multiply-adds an element, a layer's width to keep)
    kept = op in kept_ops() and not in_low_rank()
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import SAC_IGNORED_OPS, create_selective_checkpoint_contexts

    # FSDP2's hooks mark their spans with the profiler's record_function ops; those of a unit nested
    # in a recomputed block (the experts under expert parallelism) run a different number of times
    # in the recomputation than in the forward. They compute nothing: let them through unmatched.
    SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                            torch.ops.profiler._record_function_exit._RecordFunction})
    return create_selective_checkpoint_contexts(_policy)


# The options `torchpar plan` searches and the benchmarks and tests compare, by name, most memory
# first: (training.activation_checkpoint, training.activation_checkpoint_every).
OPTIONS = {"none": ("none", 1), "selective": ("selective", 1), "full every 2": ("full", 2),
           "full": ("full", 1)}


def option_name(policy: str, every: int) -> str:
    return policy + (f" every {every}" if every > 1 else "")


def option_overrides(policy: str, every: int) -> list[str]:
    """The config overrides that choose this option."""
    return ["--training.activation_checkpoint", policy, "--training.activation_checkpoint_every", str(every)]


def recomputed(index: int, policy: str, every: int) -> bool:
    """Whether block ``index`` (its global index) is wrapped: every block with ``selective``, every
    ``every``-th one (indices every-1, 2·every-1, ...) with ``full``."""
    return policy == "selective" or (policy == "full" and index % every == every - 1)


def apply_recompute(part: nn.Module, policy: str, every: int = 1) -> None:
    """Wrap the blocks of ``part`` (its ``layers``, keyed by global index) for recomputation."""
    if policy == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for key, block in list(part.layers.items()):
        if not recomputed(int(key), policy, every):
            continue
        if policy == "selective":
            part.layers[key] = checkpoint_wrapper(block, context_fn=_selective_context)
        else:
            part.layers[key] = checkpoint_wrapper(block)
