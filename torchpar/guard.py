"""The divergence guard: a step whose loss or gradient norm is not finite (or, optionally, whose
loss spikes far above the recent mean) is never applied, and non-finite weights are never saved.

Every figure it looks at is already global (all-reduced over the world), so every rank takes the
same decision without another collective; only the check of the weights before a save adds one.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (divergence); the message is the one line to show."""

    code = 3


class DivergenceGuard:
    def __init__(self, tr):
        """``tr`` is the [training] section."""
        self.action, self.spike_factor = tr.on_divergence, tr.loss_spike_factor
        self.recent: deque[float] = deque(maxlen=tr.loss_spike_window)
        self.skipped = 0

    def problem(self, loss: float, grad_norm: float) -> str | None:
        """Why this step must not be applied, or None."""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite loss {loss} or gradient norm {grad_norm}"
        if self.spike_factor > 0 and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                return (f"loss {loss:.4f} is above {self.spike_factor} x the mean {mean:.4f} of the last "
                        f"{len(self.recent)} steps")
        self.recent.append(loss)
        return None


def weights_finite(params: list[torch.Tensor]) -> bool:
    """Whether every value of every parameter on every rank is finite (one all-reduce)."""
    from torchpar.parallel.zero import local

    ok = torch.ones((), device=params[0].device if params else "cpu")
    for p in params:
        ok = ok * torch.isfinite(local(p.detach())).all()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())
