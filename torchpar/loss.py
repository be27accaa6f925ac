"""The training loss: the summed token cross-entropy, and auxiliary terms beside it.

Everything here is a sum over the tokens of one forward (a microbatch), like the cross-entropy:
the trainer multiplies each by the same ``scale`` (the ranks whose gradients are averaged, dp x cp,
over the step's global tokens), so any term is averaged right under accumulation, data and context
parallelism and pipelining.

Two ways to add a term:

- on the logits, in :func:`training_loss` (the z-loss is the worked example: a coefficient in the
  ``[loss]`` config section, computed where the cross-entropy is, on the head's stage);
- anywhere in the model, with :func:`add_auxiliary_loss` on a tensor that continues toward the
  loss (a router's balance loss on its block's output): the term's gradient joins backward where
  that tensor's does, so a term made on any pipeline stage needs nothing from the last stage. Its
  name must be one the model's adapter declares (``auxiliary_terms``), so every rank logs the same
  figures.

Each term's value is summed for the metrics (``loss/<name>``, per token over the step).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

Z_LOSS = "z_loss"
IGNORE = -100  # a target no loss is computed for (cross-entropy's ignore_index)
# A token that is no loss target (a chat prompt's: the loss is on the assistant's turns) carries
# this bit in the windows of token ids, so its mask travels with it wherever tokens go — packing,
# loader workers, prepared corpora (uint32), pipeline microbatches, context-parallel shards — and
# costs no bytes of its own. Token ids stay below it (vocabularies of up to 2^31 tokens).
NO_LOSS = 1 << 31


def token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` with the :data:`NO_LOSS` bit cleared: the ids a model reads."""
    return torch.where(tokens >= NO_LOSS, tokens - NO_LOSS, tokens)


def targets_of(tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` as cross-entropy targets: IGNORE where they carry the :data:`NO_LOSS` bit."""
    return torch.where(tokens >= NO_LOSS, IGNORE, tokens)


def target_count(rows) -> int:
    """Targets the windows ``rows`` [b, S + 1] (a host tensor or array) hold: each token after a
    window's first that carries no :data:`NO_LOSS` bit."""
    return int((rows[:, 1:] < NO_LOSS).sum())


def depth_term(k: int) -> str:
    """The metrics' name of multi-token prediction depth ``k``'s cross-entropy (loss/mtp1, ...)."""
    return f"mtp{k}"


def tokens_ahead(rows: torch.Tensor, depths: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Windows [b, S + 1] (inputs and their next tokens) -> [b, S, depths + 1]: column j holds, at
    each input position i, token i + 1 + j (column 0 the targets; column k the target of prediction
    depth k and the token depth k + 1 reads, with its :data:`NO_LOSS` bit: a reader takes
    :func:`token_ids`, the loss :func:`targets_of`), or IGNORE where that lies beyond the window or, with
    ``documents`` [b, S], where token i + j is in another document than token i (the depth would
    read across documents; the positions after it in that document are ignored too, so none
    attends to one that did)."""
    b, n = rows.shape
    seq = n - 1
    out = torch.full((b, seq, depths + 1), IGNORE, dtype=rows.dtype, device=rows.device)
    for j in range(depths + 1):
        ahead = rows[:, 1 + j:]  # [b, S - j]: token i + 1 + j for the positions that have one
        if documents is not None and j:
            ahead = torch.where(documents[:, :seq - j] == documents[:, j:], ahead, IGNORE)
        out[:, :seq - j, j] = ahead
    return out


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy over the targets (IGNORE left out: see :func:`targets_of`); works
    on vocab-sharded DTensor logits under loss_parallel."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum")


def training_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0,
                  scales: tuple = (1.0, 1.0)) -> tuple:
    """(what backward runs from, the cross-entropy alone, the z term or None) for one forward's
    logits [b, s, v]: the summed cross-entropy times ``scales[0]`` (one over the step's targets)
    plus ``z_loss`` x the sum over tokens of logsumexp(logits)², which keeps the softmax's
    normalizer near 1 (PaLM's z-loss, 1e-4 there), times ``scales[1]`` (one over its tokens: a
    term on every position, as the auxiliary terms are). The caller records the z term
    (:func:`record_term`) for each forward that counts."""
    ce = cross_entropy_sum(logits, targets)
    if not z_loss:
        return ce * scales[0], ce, None
    lse = torch.logsumexp(logits.float(), dim=-1)  # [b, s] (under loss parallel: over the sharded vocab)
    z = z_loss * lse.square().sum()
    return ce * scales[0] + z * scales[1], ce, z


class AuxiliaryTerms:
    """One training step's auxiliary terms on this rank: the names every rank logs, in order, the
    scale backward gives them, and each one's summed value."""

    def __init__(self, names: tuple[str, ...], scale: float):
        self.names, self.scale = names, scale
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        if name not in self.names:
            raise ValueError(f"auxiliary loss {name!r} is not declared: the model adapter's auxiliary_terms "
                             f"(and the [loss] section) give {list(self.names)}")
        value = value.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value  # (a replicated DTensor)
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def values(self, like: torch.Tensor) -> list[torch.Tensor]:
        """Each declared term's sum on this rank (zero where it made none), in declared order."""
        return [self.sums.get(name, torch.zeros_like(like)).to(like) for name in self.names]


_active: AuxiliaryTerms | None = None  # the step running now (the training thread's)


@contextlib.contextmanager
def auxiliary_terms(names: tuple[str, ...], scale: float):
    """The step's :class:`AuxiliaryTerms` while its forwards and backwards run."""
    global _active
    _active = terms = AuxiliaryTerms(names, scale)
    try:
        yield terms
    finally:
        _active = None


def uncounted(fn):
    """``fn`` run as a forward that is no part of the step (a pipeline's shape inference, a real
    forward torch runs once before the first step): its terms are neither counted nor attached."""
    def run(*args, **kwargs):
        global _active
        saved, _active = _active, None
        try:
            return fn(*args, **kwargs)
        finally:
            _active = saved
    return run


def counting() -> bool:
    """Whether a forward running now is one of the step's (figures made in it count): inside a
    training step, and not backward recomputing a forward (activation checkpointing), which
    would count them twice."""
    return _active is not None and torch._C._current_graph_task_id() == -1


def record_term(name: str, value: torch.Tensor) -> None:
    """Count ``value`` (already part of the loss backward runs from) in the step's figures."""
    if counting():
        _active.add(name, value)


class _Attached(torch.autograd.Function):
    """``x`` unchanged forward; backward also gives the attached term the gradient ``scale``."""

    @staticmethod
    def forward(ctx, x, term, scale):
        ctx.term, ctx.scale = (term.shape, term.dtype, term.device), scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.term
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def add_auxiliary_loss(x: torch.Tensor, name: str, value: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """``x``, with ``weight`` x ``value`` (a scalar: the term summed over this forward's tokens)
    joined to the loss through it; the figures count ``value`` itself. Outside a training step
    (evaluation, generation) the term is dropped and ``x`` returned as it is."""
    if _active is None or not torch.is_grad_enabled():
        return x
    record_term(name, value)
    # (a loss-parallel cross-entropy is a replicated DTensor: its local copy is the value)
    value = value.to_local() if hasattr(value, "to_local") else value
    return _Attached.apply(x, value, _active.scale * weight)
