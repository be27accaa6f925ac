"""The shape-only build: one rank of the real trainer's model and ZeRO engine with fake tensors
(shapes, no storage), on a fake process group of any size — how the planner's per-rank bytes
are checked against the trainer's own code for layouts far bigger than this machine."""

from __future__ import annotations

import torch

from torchpar.parallel import ParallelModel, materialize, parallelize


def build_shapes_only(model, args, layout, build_optimizer) -> ParallelModel:
    """``layout`` must have its mesh built (on a fake process group). The result has no
    pipeline schedule: nothing runs across ranks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    parts = parallelize(model, args, layout)
    with FakeTensorMode(allow_non_fake_inputs=True):
        state = materialize(parts, layout, torch.device("cpu"), 0, build_optimizer)
    return ParallelModel(parts, state, None)
