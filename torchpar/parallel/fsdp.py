"""ZeRO-3 through FSDP2: ``fully_shard`` per block, then the root; HSDP over a 2-D dp mesh."""

from __future__ import annotations

import torch
from torch import nn

from torchpar.optim import optimized
from torchpar.parallel.zero import (
    load_parts_state_dict,
    local,
    merged_view,
    nbytes,
    optimizer_state_bytes,
    parts_state_dict,
    replicas,
    unique_params,
)


def frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Store ``model``'s frozen parameters (a LoRA base) in ``dtype``, the compute dtype, before
    FSDP2 takes them: nothing updates them, so an fp32 copy would only be cast to ``dtype`` at every
    all-gather (the same values; with bf16, half the bytes held). A parameter two modules share stays
    shared. (The flat engine, ZeRO 0-2, keeps its frozen ones in the compute dtype too.)"""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.requires_grad or p.dtype == dtype or not p.is_floating_point():
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            module._parameters[name] = made[id(p)]


def apply_fsdp(model: nn.Module, dp_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool, cpu_offload: bool, experts=None) -> None:
    """ZeRO-3: each block is one all-gather / reduce-scatter unit; the root takes the rest
    (embedding, final norm, head). ``dp_mesh`` is 1-D (dp_shard, or dp_shard_cp with context
    parallelism) or 2-D (dp_replicate and that) for HSDP, where FSDP2 shards inside the second
    dimension and all-reduces across dp_replicate. ``experts``: (expert modules split over ep
    ranks, the mesh of the ranks holding the same experts): each module is a unit of its own
    over that mesh, inside its block's. Frozen parameters are stored in ``param_dtype``
    (:func:`frozen_in`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # Pinned host memory needs an accelerator; on a CPU-only run offload keeps the same code path
    # (sharded states and the optimizer step on the host) without pinning.
    offload = CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    kw = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=offload,
    )
    frozen_in(model, param_dtype)
    blocks = list(model.layers.values())
    expert_modules, expert_mesh = experts or ((), None)
    for i, block in enumerate(blocks):
        # The last block's parameters would be gathered again at once: backward starts there.
        reshard = reshard_after_forward and i < len(blocks) - 1
        for m in block.modules():
            if any(m is e for e in expert_modules):
                fully_shard(m, reshard_after_forward=reshard, **{**kw, "mesh": expert_mesh})
        fully_shard(block, reshard_after_forward=reshard, **kw)
    # The root's parameters are used last in forward and first in backward: keeping them
    # gathered saves one all-gather per step.
    fully_shard(model, reshard_after_forward=False, **kw)


class FSDPState:
    """ZeRO-3 through FSDP2: gradients are already reduce-scattered when backward returns.

    ``every_microstep``: each micro-step's backward reduce-scatters (only shards are ever kept);
    otherwise the micro-steps before the last accumulate full unsharded gradients locally.

    With expert parallelism (``ep`` > 1) an expert's gradient sums the tokens of its ep group's
    ranks and FSDP2 averages it over the ranks holding the same experts, ep times fewer than the
    other weights': :meth:`reduce_gradients` divides it by ep (FSDP2's own divide factor would
    need a pre-multiplied sum, which gloo lacks)."""

    def __init__(self, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer, tp: int,
                 every_microstep: bool = True, ep: int = 1, after_update=None):
        self.model_parts, self.optimizer, self.tp = model_parts, optimizer, tp
        self.after_update = after_update  # what must follow each change of the weights (FP8 gathers' scales)
        self.params = unique_params(model_parts)
        self.every_microstep = every_microstep
        self.ep = ep
        self.experts = [p for p in self.params if ep > 1 and "ep" in (p.device_mesh.mesh_dim_names or ())]

    def set_sync(self, enabled: bool) -> None:
        for m in self.model_parts:
            m.set_requires_gradient_sync(enabled or self.every_microstep)

    def reduce_gradients(self) -> None:
        grads = [local(p.grad) for p in self.experts if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1 / self.ep)

    def grad_pieces(self) -> list[tuple[torch.Tensor, int]]:
        # Every FSDP2 parameter is a DTensor over (dp..., tp) dims; its Replicate dims hold copies.
        return [(local(p.grad), replicas(p.grad, self.tp)) for p in self.params if p.grad is not None]

    def scale_grads(self, coef: torch.Tensor) -> None:
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if grads:  # (none on a pipeline stage that LoRA leaves without adapters)
            torch._foreach_mul_(grads, coef)

    def step(self) -> None:
        self.optimizer.step()
        if self.after_update is not None:
            self.after_update()

    def wait_params(self) -> None:
        # FSDP2's step updates the shards in place and gathers happen in forward; but a pipeline's
        # blocks stay gathered between forward and backward, and a split-backward schedule can end
        # the step with some still gathered: a reader (a save, an export) must see the shards,
        # which under FP8 all-gather are the weights themselves, the gathered ones FP8 casts.
        from torch.distributed.fsdp import FSDPModule

        for part in self.model_parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def weights(self) -> list[torch.Tensor]:
        """The weights the optimizer updates, as the flat engine's masters are: a frozen base is
        every replica group's own, from the same source (and a bf16 average could move it)."""
        return [p for p in self.params if p.requires_grad]

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        self.wait_params()
        return parts_state_dict(self.model_parts)  # (the trained shards are fp32: the master)

    model_load_template = model_state_dict  # each rank saves what it loads: its shards

    def load_model_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        load_parts_state_dict(self.model_parts, sd)
        if self.after_update is not None:
            self.after_update()

    def state_bytes(self) -> dict[str, int]:
        return {"param_bytes": sum(nbytes(p) for p in self.params),
                "grad_bytes": sum(nbytes(p.grad) for p in self.params),
                "optim_bytes": optimizer_state_bytes(self.optimizer)}

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True)

    def optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not optimized(self.optimizer):  # (torch's helpers refuse an optimizer of no parameters)
            return {}
        sd = get_optimizer_state_dict(merged_view(self.model_parts), self.optimizer, options=self._options())
        # Hyperparameters come from the config and the lr from the scheduler, not the checkpoint.
        return {k: v for k, v in sd.items() if k.startswith("state.")}

    optimizer_load_template = optimizer_state_dict

    def load_optimizer_state_dict(self, loaded: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        if not optimized(self.optimizer):
            return
        view = merged_view(self.model_parts)
        full = get_optimizer_state_dict(view, self.optimizer, options=self._options())
        full.update(loaded)
        set_optimizer_state_dict(view, self.optimizer, full, options=self._options())
