"""Tensor parallelism (Megatron-style) with DTensor, applied by module name.

Per block: wq, wk, wv, w1, w3 column-wise (each rank computes its share of heads / hidden
units), wo, w2 row-wise (partial sums, reduced on the way out). The token embedding is
row-wise (vocab-sharded table), the output head column-wise (vocab-sharded logits).

Sequence parallel: between the row-wise output and the next column-wise input the activations
stay sharded along the sequence, so norms and residual adds touch s/tp tokens; the all-reduce
becomes reduce-scatter + all-gather. Loss parallel: the logits stay vocab-sharded and
cross-entropy is computed without gathering them.
"""

from __future__ import annotations

from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _wait_for_embedding_output(module, inputs, output):
    """The row-wise embedding returns an AsyncCollectiveTensor (its reduction not yet waited
    for). Fed as an input to a torch.compile'd block, that subclass gets a zero gradient in torch
    2.13 — silently, the embedding stops learning. A clone waits for it and stays differentiable;
    the next op needs the values at once anyway."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def apply_tensor_parallel(model, tp_mesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard ``model`` (a whole model or a pipeline stage: missing parts are skipped) in place."""
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, top)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_wait_for_embedding_output)
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
            # One conversion per block input (Megatron's f operator): with sequence parallel an
            # all-gather forward / reduce-scatter backward; without it no forward collective and one
            # backward all-reduce of the summed wq/wk/wv (w1/w3) input gradients instead of one each.
            "attention": PrepareModuleInput(input_layouts=(between, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        }
        if sequence_parallel:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)
    # parallelize_module replaces each weight with a new DTensor parameter, which unties a tied
    # head; both are Shard(0) over the vocabulary, so tying them again is exact.
    model.tie_weights()
