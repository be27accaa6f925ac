"""The divergence guard: a step whose loss or gradient norm is not finite, or whose gradient norm is
exactly 0 (no parameter got any gradient: a dead model, e.g. after a learning rate far too high;
a live language model's cross-entropy always has one), or, optionally, whose loss spikes far above
the recent mean, is never applied, and non-finite weights are never saved.

Every figure it looks at is already global (all-reduced over the world), so every rank takes the
same decision without another collective; only the check of the weights before a save adds one.

The host reads a step's figures late, so that it never waits for the device in the middle of the
loop: with a fused optimizer the decision to skip is taken on the device by the optimizer kernel
itself, and the host learns of it when it next reads — one step later, or at the next log, save or
evaluation. Only the spike check needs the loss on the host before the update (one read per step).
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist

from torchpar import device as dev
from torchpar.optim import optimized
from torchpar.parallel.zero import local

# Under on_divergence = 'skip', this many steps skipped in a row stop the run: the model is no
# longer recovering (a dead or exploded model would otherwise skip to the end and exit 0).
SKIPS_IN_A_ROW = 10


class DivergenceGuard:
    def __init__(self, tr, optimizer: torch.optim.Optimizer):
        """``tr`` is the [training] section."""
        self.spike_factor = tr.loss_spike_factor
        self.recent: deque[float] = deque(maxlen=tr.loss_spike_window)
        self.skipped = 0
        self.in_a_row = 0  # steps skipped since the last one applied
        # Fused AdamW skips a step on the device (the found_inf input GradScaler uses).
        self.on_device = bool(optimizer.defaults.get("fused")) and self.spike_factor == 0
        self.pending: deque[tuple[int, torch.Tensor, object]] = deque()

    def record(self, step: int, figures: torch.Tensor, judged: bool = True) -> torch.Tensor:
        """Keep ``figures`` (global loss, gradient norm, stop flag, then the auxiliary loss terms and
        the routers' figures; on the device) to read later, started on their way to the host now;
        returns 1.0 where the step must not be applied. A step not ``judged`` is one that is not
        applied for another reason (replica groups that did not commit it): read, never a problem."""
        host = torch.empty(figures.shape, dtype=figures.dtype, pin_memory=figures.is_cuda)
        self.pending.append((step, host.copy_(figures, non_blocking=True), dev.record_event(), judged))
        return ((~torch.isfinite(figures[:2]).all()) | (figures[1] == 0)).float()

    def settle(self, upto: int) -> list[tuple[int, float, float, bool, list[float], str | None]]:
        """The recorded figures of the steps up to ``upto``, read now (waiting for those steps
        only), each as (step, loss, gradient norm, stop flag, auxiliary terms, why it was not
        applied or None)."""
        out = []
        while self.pending and self.pending[0][0] <= upto:
            step, host, event, judged = self.pending.popleft()
            if event is not None:
                event.synchronize()
            loss, grad_norm, stopping, *terms = host.tolist()
            problem = self.problem(loss, grad_norm) if judged else None
            out.append((step, loss, grad_norm, stopping > 0, terms, problem))
        return out

    def problem(self, loss: float, grad_norm: float) -> str | None:
        """Why this step must not be applied, or None."""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite loss {loss} or gradient norm {grad_norm}"
        if grad_norm == 0:
            return (f"gradient norm 0 at loss {loss:.4f}: no parameter got a gradient, the model is dead "
                    f"(a learning rate far too high is the usual cause)")
        if self.spike_factor > 0 and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                return (f"loss {loss:.4f} is above {self.spike_factor} x the mean {mean:.4f} of the last "
                        f"{len(self.recent)} steps")
        self.recent.append(loss)
        return None


@contextmanager
def skipped_where(optimizer: torch.optim.Optimizer, skip: torch.Tensor | None):
    """A fused optimizer step inside leaves parameters, moments and step count as they were where
    ``skip`` is 1.0 (on a first step, Adam's state is still created, as zeros) — the kernel reads
    it, the host does not. With CPU-offloaded parameters the flag is copied to the host first."""
    params = optimized(optimizer)
    if skip is None or not params:  # (a pipeline stage LoRA leaves without adapters updates nothing)
        yield
        return
    optimizer.found_inf = skip.to(params[0].device)
    optimizer.grad_scale = None
    try:
        yield
    finally:
        del optimizer.found_inf, optimizer.grad_scale


def weights_finite(params: list[torch.Tensor], device: torch.device) -> bool:
    """Whether every value of every parameter on every rank is finite (one all-reduce on
    ``device``, the job's: a pipeline stage that LoRA leaves without adapters holds no parameter,
    and a host tensor has no backend in an NCCL-only group)."""

    ok = torch.ones((), device=device)
    for p in params:
        ok = ok * torch.isfinite(local(p.detach())).all()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())
