"""The shape-only build: one rank of the real trainer's model and ZeRO engine with fake tensors
(shapes, no storage), on a fake process group of any size — how the planner's per-rank bytes
are checked against the trainer's own code for layouts far bigger than this machine."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchpar.parallel import ParallelModel, materialize, parallelize


def build_shapes_only(model, args, layout, build_optimizer) -> tuple[ParallelModel, FakeTensorMode]:
    """``layout`` must have its mesh built (on a fake process group). The model has no pipeline
    schedule (nothing runs across ranks); run it under the returned mode, which made its
    tensors: under another, every op converts each of them again (at 8B, minutes)."""
    parts = parallelize(model, args, layout)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        state = materialize(parts, layout, torch.device("cpu"), 0, build_optimizer)
    return ParallelModel(parts, state, None), mode
