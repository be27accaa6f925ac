"""Tensor parallelism (Megatron-style) with DTensor, from the model adapter's plan.

The adapter names each module's role in words (``models/common.py``: embedding, head, colwise,
rowwise, norm, input); this file turns the words into DTensor styles. Column-wise linears
compute each rank's share of heads or hidden units, row-wise ones produce partial sums reduced
on the way out; embeddings are row-sharded tables, the head is vocab-sharded.

Sequence parallel: between the row-wise output and the next column-wise input the activations
stay sharded along the sequence, so norms and residual adds touch s/tp tokens; the all-reduce
becomes reduce-scatter + all-gather. Loss parallel: the logits stay vocab-sharded and
cross-entropy is computed without gathering them.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor import _random as dtensor_random
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchpar.errors import ConfigError
from torchpar.models.common import WHOLE_STYLES
from torchpar.models.lora import A, B


def loss_context(enabled: bool):
    """Loss parallel's context (cross-entropy of vocab-sharded logits) when ``enabled``."""
    if enabled:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _wait_for_embedding_output(module, inputs, output):
    """A row-wise embedding returns an AsyncCollectiveTensor (its reduction not yet waited
    for). Fed as an input to a torch.compile'd block, that subclass gets a zero gradient in torch
    2.13 — silently, the embedding stops learning. A clone waits for it and stays differentiable;
    the next op needs the values at once anyway."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


class Whole(ParallelStyle):
    """A module every tp rank runs whole, on a replicated input (a DTensor): its parameters
    replicated DTensors, its output a replicated DTensor. ``summed``: its output's gradient, which
    each rank's heads give a share of, is summed over the ranks on the way back (so its own and
    earlier parameters' gradients are whole); ``local``: its output goes on as a plain tensor that
    each rank uses with its own heads (then summed, as the gradient is a share)."""

    def __init__(self, summed: bool = False, local: bool = False):
        super().__init__()
        self.summed, self.local = summed, local

    def _output(self, module, output, mesh):
        if self.summed:
            output = output.redistribute(mesh, [Replicate()])  # (backward: a partial gradient summed)
        return output.to_local(grad_placements=[Partial()]) if self.local else output

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, output_fn=self._output)


def _style(word: str, module, sequence_parallel: bool, loss_parallel: bool):
    """The DTensor style for one planned module, or None (left alone)."""
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    if word == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if word == "head":
        return ColwiseParallel(input_layouts=between,
                               output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    if word == "colwise":
        return ColwiseParallel()
    if word == "rowwise":
        return RowwiseParallel(output_layouts=between)
    if word == "head_norm":  # input [b, s, heads, head size], the heads split over tp
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if word == "rowwise_replicated":
        return RowwiseParallel(output_layouts=Replicate())
    if word == "routed":
        return PrepareModuleInputOutput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Replicate(),),
                                        desired_output_layouts=(between,), use_local_output=True)
    if word == "norm":
        return SequenceParallel() if sequence_parallel else None
    if word == "token_wise":  # token by token on the residual stream, whole on every rank; out as it came in
        return SequenceParallel(use_local_output=True) if sequence_parallel else None
    if word in WHOLE_STYLES:
        return Whole(summed=word != "replicated", local=word == "shared")
    if word in ("input", "whole_input"):
        # One conversion of the residual stream per sub-module (Megatron's f operator): with
        # sequence parallel an all-gather forward / reduce-scatter backward; without it no
        # forward collective and one backward all-reduce of the summed input gradients of the
        # column-wise linears inside, instead of one each. Further inputs pass untouched.
        extra = (None,) * (len(inspect.signature(module.forward).parameters) - 1)
        return PrepareModuleInput(
            input_layouts=(between, *extra), desired_input_layouts=(Replicate(), *extra)
        )
    raise ValueError(f"unknown tensor-parallel style {word!r}")


PARAMETER_WORDS = ("heads",)  # words that name a parameter, not a module


def plan_problem(module, plan: dict[str, str], where: str) -> str | None:
    """The one line for a plan key that names nothing in ``module`` (a misspelt key would leave its
    module replicated: the losses still match, the bytes do not), or a parameter word on a module;
    None when every key names a module, a parameter, or an optional part this module leaves out
    (an attribute set to None: a pipeline stage's missing embedding, a block's absent q/k norms)."""
    for name, word in plan.items():
        target = module
        for part in name.split("."):
            target = getattr(target, part, AttributeError)
            if target is None or target is AttributeError:
                break
        if target is AttributeError:
            return (f"the tensor-parallel plan's key {name!r} ({where}) names no module or parameter of "
                    f"{type(module).__name__}; correct the key in the model adapter's plan")
        if target is not None and (word in PARAMETER_WORDS) != isinstance(target, nn.Parameter):
            return (f"the tensor-parallel plan's key {name!r} ({where}): {word!r} is a word for "
                    f"{'a parameter' if word in PARAMETER_WORDS else 'a module'}")
    return None


def _split_parameters(module, plan: dict[str, str], tp_mesh) -> None:
    """The parameters the plan splits by their first dimension ('heads': a per-head vector, each
    rank its own heads' entries, as the column-wise projections give it its heads)."""
    for name, word in plan.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = submodule(module, owner_name) if owner_name else module
        p = getattr(owner, leaf, None) if owner is not None else None
        if word == "heads" and isinstance(p, nn.Parameter):
            # (values are filled in afterwards, from the seed: nothing to send from rank 0)
            owner.register_parameter(leaf, nn.Parameter(
                distribute_tensor(p.data, tp_mesh, [Shard(0)], src_data_rank=None), p.requires_grad))


def _place_adapters(block) -> None:
    """LoRA's adapters split as their layer's weight is (each computed by the rank holding the part
    it meets): a column-wise W [out, in] Shard(0) gives B [out, r] its rows and A [r, in] whole on
    every rank (the input is whole); a row-wise one, Shard(1), gives A its columns (each rank's part
    of the input) and B whole — ``x A^T`` is then a partial sum, which the layer's own output
    reduction adds up with ``x W^T``'s. A replicated weight, replicated adapters."""
    for layer in block.modules():
        w, a, b = (getattr(layer, n, None) for n in ("weight", A, B))
        if a is None or not isinstance(w, DTensor):
            continue
        split = next((p.dim for p in w.placements if isinstance(p, Shard)), None)
        places = {0: ([Replicate()], [Shard(0)]), 1: ([Shard(1)], [Replicate()])}.get(split,
                                                                                      ([Replicate()],) * 2)
        for name, t, place in ((A, a, places[0]), (B, b, places[1])):
            # (on the meta device: a new empty tensor of the full shape, split with no communication)
            full = torch.empty(t.shape, device="meta")
            layer.register_parameter(name, nn.Parameter(
                distribute_tensor(full, w.device_mesh, place, src_data_rank=None), t.requires_grad))


def submodule(module, name: str):
    """``module``'s submodule ``name``, or None where it has none (a pipeline stage lacks some
    top-level modules; a block may lack optional ones)."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _plan(module, plan: dict[str, str], sequence_parallel: bool, loss_parallel: bool) -> dict:
    out = {}
    for name, word in plan.items():
        if word in PARAMETER_WORDS:
            continue  # (_split_parameters)
        target = submodule(module, name)
        style = _style(word, target, sequence_parallel, loss_parallel) if target is not None else None
        if style is not None:
            out[name] = style
    return out


def random_without_broadcast(tp_mesh) -> None:
    """DTensor's random ops (LoRA's dropout on a tensor-parallel input) take their generator state
    from torch's, which every rank seeds alike. Left to itself, DTensor makes its generator tracker
    at its first random op and broadcasts rank 0's state over the whole world there: pipeline
    stages reach that op one after another (stage 1 only once stage 0's activations arrive), and
    a stage without the op never does, so the job would hang. Made here, before any forward,
    without the broadcast. DTensor has random ops on GPUs only (CPU jobs refuse the dropout)."""
    if tp_mesh.device_type != "cpu" and dtensor_random._rng_tracker is None:
        dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(tp_mesh, run_state_sync=False)


def apply_tensor_parallel(module, model, args, tp_mesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard ``module`` (a whole model or a pipeline stage: modules a stage lacks are skipped) in
    place by its adapter ``model``'s plan for ``args``. (Stacked experts are split by
    ``parallel.experts``.)"""
    problems = [plan_problem(module, model.top_plan, "top_plan")]
    problems += [plan_problem(block, model.layer_plan(args, int(layer)), f"block {layer}")
                 for layer, block in module.layers.items()]
    if any(problems):  # (every rank the same line, before the first collective of TP)
        raise ConfigError(next(p for p in problems if p))
    random_without_broadcast(tp_mesh)
    parallelize_module(module, tp_mesh, _plan(module, model.top_plan, sequence_parallel, loss_parallel))
    _split_parameters(module, model.top_plan, tp_mesh)
    for name, word in model.top_plan.items():
        if word == "embedding" and getattr(module, name) is not None:
            getattr(module, name).register_forward_hook(_wait_for_embedding_output)
    for layer, block in module.layers.items():
        plan = model.layer_plan(args, int(layer))
        parallelize_module(block, tp_mesh, _plan(block, plan, sequence_parallel, loss_parallel))
        _split_parameters(block, plan, tp_mesh)
        _place_adapters(block)
    # parallelize_module replaces each weight with a new DTensor parameter, which unties a tied
    # head; both are Shard(0) over the vocabulary, so tying them again is exact.
    module.tie_weights()
