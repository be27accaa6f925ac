"""Mixture of experts: a router sends each token to ``top_k`` of ``experts`` SwiGLU experts and mixes
their outputs by its weights; optional shared experts see every token.

Shapes: t tokens (batch x sequence, flattened), d the model's width, h an expert's hidden width,
e experts, k experts chosen per token.

Routing (the shape of DeepSeek-V3's and Qwen3-MoE's layers, one module): scores = softmax or sigmoid
of the router's logits [t, e]; each token takes the k experts of highest ``score + bias``, where
``bias`` is the auxiliary-loss-free balancing bias (a buffer changed between steps from the experts'
loads, never by gradients: it steers the choice, not the weights). The weights are the chosen
scores, normalized to sum 1 if asked, times ``route_scale``. Ties go to the lower expert index (a
stable sort), so the choice is a function of the scores alone.

Dispatch: the t x k (token, expert) slots are sorted by expert (stable: token order within an
expert), the experts run as grouped GEMMs over their contiguous rows, and each slot's output goes
back to its place; a token's output is the weighted sum of its k slots, added in a fixed order (no
atomic adds, so the result does not depend on scheduling). A capacity factor c > 0 keeps at most
ceil(c x t x k / e) slots per expert (the earliest tokens) and drops the rest (zero output); 0 keeps
every slot (dropless).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchpar.loss import add_auxiliary_loss
from torchpar.models.common import SwiGLU

BALANCE_LOSS = "balance"  # the auxiliary term's name in the metrics (loss/balance)


def grouped_mm_problem(dtype: torch.dtype, device: torch.device, *widths: int) -> str | None:
    """Why ``torch._grouped_mm`` cannot run the experts' matmuls here, or None where it can: its
    rows must start at multiples of 16 bytes, and on CUDA it takes bf16 only."""
    size = dtype.itemsize
    odd = [w for w in widths if w * size % 16]
    if odd:
        return f"a width of {odd[0]} x {size} bytes is no multiple of 16 bytes"
    if device.type == "cuda" and dtype != torch.bfloat16:
        return f"grouped GEMM on CUDA takes bfloat16, not {str(dtype).removeprefix('torch.')}"
    return None


class Router(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, score: str = "softmax", normalize: bool = True,
                 route_scale: float = 1.0):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k = {top_k} must be between 1 and the {experts} experts")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score {score!r} is not 'softmax' or 'sigmoid'")
        self.top_k, self.score, self.normalize, self.route_scale = top_k, score, normalize, route_scale
        self.gate = nn.Linear(dim, experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [t, d] -> (weights [t, k], chosen experts [t, k], scores [t, e] in fp32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = torch.sort(scores.detach() + self.expert_bias, dim=-1, descending=True,
                            stable=True).indices[:, :self.top_k]
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.route_scale, chosen, scores


class Experts(nn.Module):
    """``experts`` SwiGLU MLPs with their weights stacked: w1, w3 [e, d, h], w2 [e, h, d]."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.trunc_normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool = True) -> torch.Tensor:
        """x [n, d], rows sorted by expert, ``counts`` [e] rows each -> [n, d]."""
        if grouped:
            ends = torch.cumsum(counts, 0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, self.w1, offs=ends)) * torch._grouped_mm(x, self.w3, offs=ends)
            return torch._grouped_mm(h, self.w2, offs=ends)
        out, start = [], 0
        for i, n in enumerate(counts.tolist()):  # the per-expert loop: one sync for the counts
            rows = x[start:start + n]
            out.append((F.silu(rows @ self.w1[i]) * (rows @ self.w3[i])) @ self.w2[i])
            start += n
        return torch.cat(out)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, shared_hidden: int = 0,
                 score: str = "softmax", normalize: bool = True, route_scale: float = 1.0,
                 capacity_factor: float = 0.0, balance_coeff: float = 0.0):
        super().__init__()
        self.router = Router(dim, experts, top_k, score, normalize, route_scale)
        self.experts = Experts(dim, hidden, experts)
        self.shared = SwiGLU(dim, shared_hidden) if shared_hidden else None  # every token's experts, as one
        self.capacity_factor, self.balance_coeff = capacity_factor, balance_coeff
        self.hidden = hidden
        # Slots each expert received and slots dropped since the trainer last read them (for the
        # balancing bias and the metrics); not saved.
        self.register_buffer("loads", torch.zeros(experts, dtype=torch.float32), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.float32), persistent=False)

    def grouped_problem(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why the experts run as a per-expert loop here, or None: they run as grouped GEMM."""
        return grouped_mm_problem(dtype, device, self.experts.w1.shape[1], self.hidden)

    def how(self, dtype: torch.dtype, device: torch.device) -> str:
        """How the experts run: grouped GEMM, or the per-expert loop and why."""
        problem = self.grouped_problem(dtype, device)
        return "grouped GEMM" if problem is None else f"a loop over the experts ({problem})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [t, d]
        t, e, k = x.shape[0], self.loads.numel(), self.router.top_k
        weights, chosen, scores = self.router(x)
        slots = chosen.reshape(-1)  # [t k]: token i's slots at i k .. i k + k - 1
        order = torch.argsort(slots, stable=True)  # by expert, token order within one
        counts = torch.bincount(slots, minlength=e)
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * t * k / e)
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(t * k, device=x.device) - starts[slots[order]]
            order = order[rank_in_expert < capacity]
            kept = torch.clamp(counts, max=capacity)
            self.dropped += (counts - kept).sum()
            counts = kept
        self.loads += counts.float()
        grouped = self.grouped_problem(x.dtype, x.device) is None
        out = self.experts(x[order // k], counts, grouped)  # [kept slots, d]
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        placed = out.new_zeros(t * k, shape[-1]).index_copy(0, order, out)  # each slot once
        y = placed.view(t, k, -1).sum(1)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.balance_coeff:
            y = add_auxiliary_loss(y, BALANCE_LOSS, self.balance_coeff * t * balance_loss(scores, slots, e))
        return y.view(shape)


def balance_loss(scores: torch.Tensor, slots: torch.Tensor, experts: int) -> torch.Tensor:
    """The auxiliary balance term per token: experts x sum over experts of (the share of slots it
    received) x (its mean normalized score); 1 when balanced, up to ``experts`` when one expert
    takes every slot. Its gradient reaches the router through the scores only."""
    share = torch.bincount(slots, minlength=experts).float() / slots.numel()
    mean_score = (scores / scores.sum(-1, keepdim=True)).mean(0)
    return experts * (share * mean_score).sum()


def update_bias(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """The auxiliary-loss-free balancing step: each expert's bias moves by ``rate`` toward the mean
    load (up when it received fewer slots than the mean, down when more, unchanged when equal)."""
    return bias + rate * torch.sign(loads.mean() - loads)
