"""Mixture of experts: a router sends each token to ``top_k`` of ``experts`` SwiGLU experts and mixes
their outputs by its weights; optional shared experts see every token.

Shapes: t tokens (batch x sequence, flattened), d the model's width, h an expert's hidden width,
e experts, k experts chosen per token.

Routing (the shape of DeepSeek-V3's and Qwen3-MoE's layers, one module): scores = softmax or sigmoid
of the router's logits [t, e]; each token takes the k experts of highest ``score + bias``, where
``bias`` is the auxiliary-loss-free balancing bias (a buffer changed between steps from the experts'
loads, never by gradients: it steers the choice, not the weights). The weights are the chosen
scores, normalized to sum 1 if asked, times ``route_scale``. Ties go to the lower expert index (a
stable sort), so the choice is a function of the scores alone. Group-limited routing (DeepSeek-V3's
node-limited routing) first keeps, per token, the ``route_top_groups`` of ``route_groups`` groups
of consecutive experts whose two best ``score + bias`` sum highest, then takes the k experts among
theirs: under expert parallelism with as many ranks as groups, each group is one rank's experts, so
a token's slots go to at most ``route_top_groups`` ranks.

Dispatch: the t x k (token, expert) slots are sorted by expert (stable: token order within an
expert), the experts run as grouped GEMMs over their contiguous rows, and each slot's output goes
back to its place; a token's output is the weighted sum of its k slots, added in a fixed order (no
atomic adds, so the result does not depend on scheduling). A capacity factor c > 0 keeps at most
ceil(c x s x k / e) slots per expert of each sequence of s tokens (its earliest tokens) and drops the
rest (zero output); 0 keeps every slot (dropless). The capacity and the balance term act per
sequence, so neither depends on how sequences are split over ranks and microbatches.

The second half of the file is the ``moe`` family: Llama's blocks with these layers as their
feed-forwards, its flavours and adapter, and :class:`Routing`, what the trainer does with the
routers after each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from torchpar.loss import add_auxiliary_loss, counting
from torchpar.models.common import StackRow, SwiGLU, canonical_name
from torchpar.models.llama import LlamaAdapter, ModelArgs, Transformer, TransformerBlock

BALANCE_LOSS = "balance"  # the auxiliary term's name in the metrics (loss/balance)
# Every MoE block's balancing bias [blocks, experts], by its name in checkpoints (Routing's part),
# weights files and Hugging Face mappings
BIAS_STATE = "routing.expert_bias"


MAX_GROUPS = 1023  # torch's grouped GEMM sets up its groups in one CUDA block of 1024 threads


def grouped_mm_problem(dtype: torch.dtype, device: torch.device, *widths: int, groups: int = 1,
                       tensors: tuple[torch.Tensor, ...] = ()) -> str | None:
    """Why ``torch._grouped_mm`` cannot run the experts' matmuls here, or None where it can: its
    rows must start at multiples of 16 bytes (the widths, and each operand's first element:
    ``tensors``, where known), it takes at most MAX_GROUPS experts at once, and on CUDA bf16 only,
    from compute capability 8.0."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"grouped GEMM takes float32, bfloat16 or float16, not {str(dtype).removeprefix('torch.')}"
    size = dtype.itemsize
    odd = [w for w in widths if w * size % 16]
    if odd:
        return f"a width of {odd[0]} x {size} bytes is no multiple of 16 bytes"
    if any(t.data_ptr() % 16 for t in tensors):
        return "an operand starts at an address that is no multiple of 16 bytes"
    if groups > MAX_GROUPS:
        return f"{groups} experts on a rank, grouped GEMM takes at most {MAX_GROUPS}"
    if device.type == "cuda" and dtype != torch.bfloat16:
        return f"grouped GEMM on CUDA takes bfloat16, not {str(dtype).removeprefix('torch.')}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "grouped GEMM on CUDA needs compute capability 8.0 (A100) or later"
    return None


def how_experts_run(dtype: torch.dtype, device: torch.device, dim: int, hidden: int, experts: int) -> str:
    """Grouped GEMM, or the per-expert loop and why, for ``experts`` experts (on a rank) ``dim``
    wide with ``hidden`` units."""
    problem = grouped_mm_problem(dtype, device, dim, hidden, groups=experts)
    return "grouped GEMM" if problem is None else f"a loop over the experts ({problem})"


class Router(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, score: str = "softmax", normalize: bool = True,
                 route_scale: float = 1.0, groups: int = 1, top_groups: int = 1, logit_bias: bool = False):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k = {top_k} must be between 1 and the {experts} experts")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score {score!r} is not 'softmax' or 'sigmoid'")
        self.top_k, self.score, self.normalize, self.route_scale = top_k, score, normalize, route_scale
        self.groups, self.top_groups = groups, top_groups
        self.gate = nn.Linear(dim, experts, bias=logit_bias)  # (a learned bias on the logits: gpt-oss's)
        # Not in the model's state: the trainer saves every block's bias in one place (Routing).
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [t, d] -> (weights [t, k], chosen experts [t, k], scores [t, e] in fp32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias  # [t, e]
        if self.groups > 1:
            choice = self.within_top_groups(choice)
        chosen = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.route_scale, chosen, scores

    def within_top_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [t, e] with every expert outside the token's ``top_groups`` best groups at -inf;
        a group's worth is the sum of its two best choices (its one, in groups of one expert)."""
        t, e = choice.shape
        per_group = choice.view(t, self.groups, e // self.groups)  # [t, g, e/g]
        worth = per_group.topk(min(2, e // self.groups), dim=-1).values.sum(-1)  # [t, g]
        kept = torch.sort(worth, dim=-1, descending=True, stable=True).indices[:, :self.top_groups]
        inside = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, kept, True)  # [t, g]
        return choice.masked_fill(~inside.repeat_interleave(e // self.groups, dim=1), float("-inf"))


GPT_OSS_ALPHA = 1.702  # gpt-oss's clamped SwiGLU: gate x sigmoid(alpha x gate), as GELU's sigmoid form


class Experts(nn.Module):
    """``experts`` SwiGLU MLPs with their weights stacked: w1, w3 [e, d, h], w2 [e, h, d]; with
    ``biases`` (gpt-oss's) a bias per expert on each, w1_bias, w3_bias [e, h] and w2_bias [e, d].
    ``limit`` > 0 is gpt-oss's clamped form: gate <= limit, -limit <= up <= limit, and
    gate x sigmoid(1.702 gate) x (up + 1). Parallel code may split the stacks (experts over ranks,
    the hidden width h over tensor-parallel ranks) and call :meth:`run` with its pieces, whose
    outputs are partial sums over h, then :meth:`finish` once on their sum."""

    def __init__(self, dim: int, hidden: int, experts: int, biases: bool = False, limit: float = 0.0):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.trunc_normal_(w, std=0.02)
        self.w1_bias, self.w3_bias, self.w2_bias = (
            (nn.Parameter(torch.zeros(experts, hidden)), nn.Parameter(torch.zeros(experts, hidden)),
             nn.Parameter(torch.zeros(experts, dim))) if biases else (None, None, None))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        """x [n, d], rows sorted by expert, ``counts`` [e] rows each -> [n, d]."""
        out = self.run(x, counts, self.w1, self.w3, self.w2, self.w1_bias, self.w3_bias, grouped=grouped)
        return self.finish(out, counts, self.w2_bias)

    def run(self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
            w2: torch.Tensor, b1: torch.Tensor | None = None, b3: torch.Tensor | None = None,
            grouped: bool | None = None) -> torch.Tensor:
        """The experts of the stacks given (any number of them, any hidden width) on their rows, up
        to the output bias: grouped GEMM where it can run (see :func:`grouped_mm_problem`;
        ``grouped`` = False asks for the loop), else a per-expert loop."""
        def act(gate, up):
            if not self.limit:
                return F.silu(gate) * up
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1)

        def expert(rows, i):
            gate, up = rows @ w1[i], rows @ w3[i]
            if b1 is not None:
                gate, up = gate + b1[i], up + b3[i]
            return act(gate, up) @ w2[i]

        if x.device.type == "meta":
            # The planner's trace: one expert's matmuls make the same shapes (grouped GEMM's meta
            # function asks for CUDA's bf16, and the loop would read the counts).
            return expert(x, 0)
        if grouped is None:
            grouped = grouped_mm_problem(x.dtype, x.device, w1.shape[1], w1.shape[2], groups=w1.shape[0],
                                         tensors=(x, w1, w3, w2)) is None
        if grouped:
            ends = torch.cumsum(counts, 0).to(torch.int32)
            gate, up = torch._grouped_mm(x, w1, offs=ends), torch._grouped_mm(x, w3, offs=ends)
            if b1 is not None:
                gate, up = gate + per_row(b1, counts, x.shape[0]), up + per_row(b3, counts, x.shape[0])
            return torch._grouped_mm(act(gate, up), w2, offs=ends)
        out, start = [], 0
        for i, n in enumerate(counts.tolist()):  # the per-expert loop: one sync for the counts
            out.append(expert(x[start:start + n], i))
            start += n
        return torch.cat(out)

    @staticmethod
    def finish(out: torch.Tensor, counts: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
        """The experts' output [n, d] with each row's output bias: added once, after the partial
        sums of the hidden width's pieces are added."""
        return out if b2 is None else out + per_row(b2, counts, out.shape[0])


def per_row(stack: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Each expert's row of ``stack`` [e, n] repeated for its ``counts`` rows: [rows, n]."""
    return stack.repeat_interleave(counts, dim=0, output_size=rows)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, shared_hidden: int = 0,
                 score: str = "softmax", normalize: bool = True, route_scale: float = 1.0,
                 capacity_factor: float = 0.0, balance_coeff: float = 0.0, groups: int = 1,
                 top_groups: int = 1, biases: bool = False, limit: float = 0.0):
        super().__init__()
        self.router = Router(dim, experts, top_k, score, normalize, route_scale, groups, top_groups, biases)
        self.experts = Experts(dim, hidden, experts, biases, limit)
        self.shared = SwiGLU(dim, shared_hidden) if shared_hidden else None  # every token's experts, as one
        self.capacity_factor, self.balance_coeff = capacity_factor, balance_coeff
        self.hidden = hidden
        # Slots each expert received and slots dropped since the trainer last read them (for the
        # balancing bias and the metrics); not saved.
        self.register_buffer("loads", torch.zeros(experts, dtype=torch.float32), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.float32), persistent=False)
        # Under group-limited routing, the groups each token's slots reached, summed over tokens.
        self.register_buffer("reach", torch.zeros((), dtype=torch.float32), persistent=False)

    def how(self, dtype: torch.dtype, device: torch.device) -> str:
        """How the experts run: grouped GEMM, or the per-expert loop and why."""
        return how_experts_run(dtype, device, self.experts.w1.shape[1], self.hidden, self.experts.w1.shape[0])

    # Eager between a compiled block's graphs: its shapes follow the routing (rows per expert, and
    # under expert parallelism the rows each rank sends), so a graph of it would be compiled again
    # for every new count (a minute per MoE block on a CPU), and grouped GEMM's fake kernel takes
    # bf16 only. torch.compile still fuses the block's attention and norms around it.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = shape[0] if len(shape) == 3 else 1  # sequences (a [t, d] input is one)
        x = x.reshape(-1, shape[-1])  # [t, d]
        t, e, k = x.shape[0], self.loads.numel(), self.router.top_k
        weights, chosen, scores = self.router(x)
        slots = chosen.reshape(-1)  # [t k]: token i's slots at i k .. i k + k - 1
        order = torch.argsort(slots, stable=True)  # by expert, token order within one
        counts = expert_counts(slots, e)
        if self.capacity_factor > 0:
            # Per sequence (as the balance term): each expert keeps its first ceil(c s k / e) slots of
            # each sequence, so what is dropped does not depend on how sequences meet in a forward.
            per_row = t * k // rows
            capacity = math.ceil(self.capacity_factor * per_row / e)
            group = slots + e * (torch.arange(t * k, device=x.device) // per_row)  # (sequence, expert)
            by_group = torch.argsort(group, stable=True)
            sizes = expert_counts(group, rows * e)
            starts = torch.cumsum(sizes, 0) - sizes
            rank_in_group = torch.arange(t * k, device=x.device) - starts[group[by_group]]
            keep = torch.empty_like(slots, dtype=torch.bool)
            keep[by_group] = rank_in_group < capacity
            order = order[keep[order]]
            kept = expert_counts(slots[order], e)
            if counting():
                self.dropped += (counts - kept).sum()
            counts = kept
        if counting():  # a training forward (not its recomputation in backward, nor evaluation)
            self.loads += counts.float()
            if self.router.groups > 1:
                reached = torch.zeros(t, self.router.groups, device=x.device)
                self.reach += reached.scatter_(1, chosen // (e // self.router.groups), 1.0).sum()
        out = self.experts(x[order // k], counts)  # [kept slots, d]
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        placed = out.new_zeros(t * k, shape[-1]).index_copy(0, order, out)  # each slot once
        y = placed.view(t, k, -1).sum(1)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.balance_coeff:
            # Per sequence, times its tokens: the sum over sequences does not depend on how they are
            # split into ranks and microbatches.
            term = balance_loss(scores.view(rows, -1, e), slots.view(rows, -1), e).sum() * (t // rows)
            y = add_auxiliary_loss(y, BALANCE_LOSS, self.balance_coeff * term)
        return y.view(shape)


def balance_loss(scores: torch.Tensor, slots: torch.Tensor, experts: int) -> torch.Tensor:
    """The auxiliary balance term of each sequence, scores [n, s, e] and slots [n, s k] -> [n]:
    experts x sum over experts of (the share of the sequence's slots it received) x (its mean
    normalized score); 1 when balanced, up to ``experts`` when one expert takes every slot (the
    sequence-wise form of DeepSeek-V3's). Its gradient reaches the router through the scores only."""
    n = slots.shape[0]
    flat = slots + experts * torch.arange(n, device=slots.device).unsqueeze(1)  # [n, s k], per sequence
    share = expert_counts(flat.flatten(), n * experts).view(n, experts).float() / slots.shape[1]
    mean_score = (scores / scores.sum(-1, keepdim=True)).mean(1)  # [n, e]
    return experts * (share * mean_score).sum(-1)


def expert_counts(slots: torch.Tensor, experts: int) -> torch.Tensor:
    """Slots per expert [experts]. A scatter, not bincount: its shape does not depend on the
    values, so the planner can trace the layer on the meta device."""
    counts = torch.zeros(experts, dtype=torch.long, device=slots.device)
    return counts.scatter_add_(0, slots, torch.ones_like(slots))


def update_bias(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """The auxiliary-loss-free balancing step: each expert's bias moves by ``rate`` toward the mean
    load (up when it received fewer slots than the mean, down when more, unchanged when equal)."""
    return bias + rate * torch.sign(loads.mean() - loads)


# ---------------------------------------------------------------- the family: Llama blocks, MoE feed-forwards


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    experts: int = 8  # routed experts per MoE block
    top_k: int = 2  # experts each token goes to
    moe_hidden: int = 256  # a routed expert's SwiGLU width
    shared_hidden: int = 0  # the shared experts' width, as one SwiGLU every token passes (0 = none)
    dense_layers: int = 0  # the first blocks keep a dense SwiGLU (ffn_hidden wide)
    score: str = "softmax"  # router scores: 'softmax' (Qwen3-MoE) or 'sigmoid' (DeepSeek-V3)
    normalize_top_k: bool = True  # the chosen k weights rescaled to sum 1
    route_scale: float = 1.0  # the weights' factor after that
    capacity_factor: float = 0.0  # 0 = dropless; c > 0: at most ceil(c s k / e) slots per expert and sequence
    balance_coeff: float = 0.0  # the auxiliary balance loss's coefficient (0 = none)
    bias_rate: float = 0.0  # the auxiliary-loss-free bias's step per optimizer step (0 = none)
    route_groups: int = 1  # groups of consecutive experts for group-limited routing (1 = none)
    route_top_groups: int = 1  # the groups each token's experts are chosen from (with route_groups > 1)
    expert_biases: bool = False  # biases on the router's logits and every expert's projections (gpt-oss)
    swiglu_limit: float = 0.0  # > 0: gpt-oss's clamped SwiGLU in the experts (gpt-oss: 7)

    @property
    def routed_blocks(self) -> int:
        """The model's own routed blocks (each prediction depth's is routed too)."""
        return self.n_layers - self.dense_layers

    @property
    def moe_layers(self) -> range:
        """Every routed block: the model's after its dense ones, then the prediction depths'."""
        return range(self.dense_layers, self.n_layers + self.mtp_depth)


# Tiny but shaped like the big ones: 4 blocks (pp 2 x 2), the first dense; 8 experts of 64 (ep 2, 4
# and 8 divide them; 64 x 4 bytes rows for grouped GEMM), top 2; vocab 4096 = the shipped tokenizer's.
DEBUG = MoEArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=64,
                rope_theta=10000.0, max_seq_len=2048, experts=8, top_k=2, moe_hidden=64, dense_layers=1,
                qk_norm=True)
FLAVORS: dict[str, MoEArgs] = {
    # Qwen3-MoE's routing: softmax, the top k renormalized, no shared expert (DeepSeek-V3's shapes:
    # the deepseek_v3 family, models/deepseek.py)
    "debug": DEBUG,
    # Qwen3-30B-A3B: 48 blocks of 128 experts (768 wide), top 8, heads of 128 (wider than dim / heads).
    "qwen3-30B-A3B": MoEArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_size=128, qk_norm=True,
                             vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, max_seq_len=40960,
                             experts=128, top_k=8, moe_hidden=768, multiple_of=2048),
}


class MoETransformer(Transformer):
    """Llama's decoder whose blocks after the first ``dense_layers`` route to experts."""

    def block(self, args: MoEArgs, layer: int) -> nn.Module:
        if layer < args.dense_layers:
            return TransformerBlock(args, layer=layer)
        return TransformerBlock(args, MoE(args.dim, args.moe_hidden, args.experts, args.top_k,
                                          args.shared_hidden, args.score, args.normalize_top_k,
                                          args.route_scale, args.capacity_factor, args.balance_coeff,
                                          args.route_groups, args.route_top_groups, args.expert_biases,
                                          args.swiglu_limit),
                                layer)

    def init_std(self, name: str) -> float | str:
        if name.endswith("experts.w2"):  # a residual projection, like the dense w2
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        if name.endswith("_bias"):  # (the experts' biases: start as none, as the projections' do)
            return "zeros"
        return super().init_std(name)

    def reset_buffers(self, device: torch.device | None) -> None:
        super().reset_buffers(device)
        for m in self.modules():
            if isinstance(m, MoE):
                for name in ("loads", "dropped", "reach"):
                    setattr(m, name, torch.zeros_like(getattr(m, name), device=device))
                m.router.expert_bias = torch.zeros_like(m.router.expert_bias, device=device)


class Routing:
    """The routers of one rank's model parts as the trainer sees them after each step: every MoE
    block's expert loads (and dropped slots) to sum over all ranks, the auxiliary-loss-free bias
    moved from the summed loads, and the step's figures. The bias of every MoE block is kept here
    on every rank (the same everywhere: it follows from the summed loads alone) and saved as the
    checkpoint's ``routing`` part; the blocks a rank holds read their rows."""

    def __init__(self, parts: list[nn.Module], args: MoEArgs):
        self.args = args
        # the figures' names in the metrics; with group-limited routing, the groups (with as many
        # expert-parallel ranks as groups: the ranks) a token's slots reach, on average
        self.names = ("moe/max_load", "moe/dropped", "moe/bias_range") + (
            ("moe/groups_per_token",) if args.route_groups > 1 else ())
        # The row of each MoE block this rank holds (routed blocks follow the dense ones) -> its layer.
        self.here = {int(canonical_name(n).split(".")[1]) - args.dense_layers: m
                     for part in parts for n, m in part.named_modules() if isinstance(m, MoE)}
        # (where the figures are reduced: the buffers' device, also on a stage without a MoE block)
        device = next(b.device for part in parts for b in part.buffers())
        self.bias = torch.zeros(len(args.moe_layers), args.experts, device=device)

    def take(self) -> torch.Tensor:
        """[MoE blocks x (experts + 2)]: each block's slots per expert, dropped slots and the groups
        its tokens reached since the last take, zero for blocks on other ranks; the blocks'
        counters restart."""
        e = self.args.experts
        out = self.bias.new_zeros(self.bias.shape[0], e + 2)
        for row, m in self.here.items():
            out[row, :e], out[row, e], out[row, e + 1] = m.loads, m.dropped, m.reach
            for counter in (m.loads, m.dropped, m.reach):
                counter.zero_()
        return out.flatten()

    def update(self, summed: torch.Tensor) -> torch.Tensor:
        """Move the bias by the loads of every rank (``take`` summed over the world); returns the
        figures named by :attr:`names`: the largest load over the mean of any block, the share of
        slots dropped, the bias's range."""
        counts = summed.view(self.bias.shape[0], -1)
        e = self.args.experts
        loads, dropped, reach = counts[:, :e], counts[:, e], counts[:, e + 1]
        if self.args.bias_rate:
            self.bias = update_bias(self.bias, loads, self.args.bias_rate)
            self.sync()
        slots = loads.sum() + dropped.sum()
        figures = [(loads.max(1).values / loads.mean(1).clamp(min=1e-9)).max(),
                   dropped.sum() / slots.clamp(min=1), self.bias.max() - self.bias.min()]
        if self.args.route_groups > 1:  # (every token takes top_k slots: slots / top_k tokens)
            figures.append(reach.sum() / (slots / self.args.top_k).clamp(min=1))
        return torch.stack(figures)

    def sync(self) -> None:
        """The blocks this rank holds take their rows of the bias."""
        for row, m in self.here.items():
            m.router.expert_bias.copy_(self.bias[row])

    def state_dict(self) -> dict:
        return {"expert_bias": self.bias}

    def load_state_dict(self, sd: dict) -> None:
        self.bias = sd["expert_bias"].to(self.bias.device)
        self.sync()

    def start_from(self, values) -> None:
        """Take the bias a weights source holds (a weights file's or Hugging Face folder's
        ``BIAS_STATE``: a LazyWeight or a tensor), if it holds one; it steers the routers from the
        first step (and at inference)."""
        if BIAS_STATE in values:
            bias = values[BIAS_STATE]
            self.load_state_dict({"expert_bias": bias.read() if hasattr(bias, "read") else bias})


class MoEAdapter(LlamaAdapter):
    name = "moe"
    model_class = MoETransformer
    args_class = MoEArgs
    flavors = FLAVORS

    # (the output bias is whole on every tp rank, added after the hidden width's partial sums)
    expert_plan = {"feed_forward.experts": {"w1": 2, "w3": 2, "w2": 1, "w1_bias": 1, "w3_bias": 1,
                                            "w2_bias": None}}
    # A routed block under TP: attention as Llama's; the MoE layer runs on every tp rank's copy of
    # all tokens (routing needs them; the ranks choose alike), its experts' and shared experts'
    # hidden width split over the tp ranks and their partial sums all-reduced.
    routed_plan = {"ffn_norm": "norm", "feed_forward": "routed", "feed_forward.shared.w1": "colwise",
                   "feed_forward.shared.w3": "colwise", "feed_forward.shared.w2": "rowwise_replicated"}

    def feed_forward_words(self, args: MoEArgs, layer: int) -> dict[str, str]:
        return self.feed_forward_plan if layer < args.dense_layers else self.routed_plan

    def experts(self, args: MoEArgs) -> int:
        return args.experts

    def stack_shape(self, args: MoEArgs, name: str) -> tuple[int, int, int] | None:
        e, d, h = args.experts, args.dim, args.moe_hidden
        return {"feed_forward.experts.w1": (e, d, h), "feed_forward.experts.w3": (e, d, h),
                "feed_forward.experts.w2": (e, h, d)}.get(name)

    # -- Hugging Face: transformers' Qwen3-MoE (softmax routing, no shared expert)

    hf_architecture = "Qwen3MoeForCausalLM"
    hf_qk_norm = True

    def hf_problem(self, args: MoEArgs) -> str | None:
        return self.hf_unlike(args, (
            ("score", args.score == "softmax"), ("shared_hidden", not args.shared_hidden),
            ("route_scale", args.route_scale == 1.0), ("qk_norm", args.qk_norm),
            ("tie_embeddings", not args.tie_embeddings), ("attn_sink", not args.attn_sink),
            ("sliding_window", not args.sliding_window), ("route_groups", args.route_groups == 1),
            ("kv_lora_rank", not args.latent), ("mtp_depth", not args.mtp_depth),
            ("expert_biases", not args.expert_biases), ("swiglu_limit", not args.swiglu_limit),
            ("bias_rate", not args.bias_rate)),
            "routes by softmax scores without shared experts, a route scale, expert groups or a balancing "
            "bias (its routers would choose other experts), has no attention sinks, sliding windows, "
            "latent attention, multi-token prediction or experts' biases, runs plain SwiGLU experts, and "
            "has per-head q/k norms and an untied head")

    def hf_config(self, args: MoEArgs) -> dict:
        dense = super().hf_config(args)
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "rope_parameters",
                "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "hidden_act",
                "attention_bias")
        # (transformers 5 writes num_local_experts, 4.x num_experts: both, either read)
        return {"architectures": [self.hf_architecture], "model_type": "qwen3_moe",
                **{k: dense[k] for k in keep}, "moe_intermediate_size": args.moe_hidden,
                "num_experts": args.experts, "num_local_experts": args.experts,
                "num_experts_per_tok": args.top_k, "norm_topk_prob": args.normalize_top_k,
                "decoder_sparse_step": 1, "mlp_only_layers": list(range(args.dense_layers))}

    def hf_tensors(self, args: MoEArgs) -> list[tuple[str, str, object]]:
        out = []
        for name, hf, how in super().hf_tensors(args):
            layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
            if layer in args.moe_layers and ".feed_forward." in name:
                continue  # the routed block's feed-forward: below
            out.append((name, hf, how))
            if layer in args.moe_layers and name.endswith("ffn_norm.weight"):
                m, f = f"model.layers.{layer}.mlp", f"layers.{layer}.feed_forward"
                out.append((f"{f}.router.gate.weight", f"{m}.gate.weight", None))
                out += [(f"{f}.experts.{w}", f"{m}.experts.{j}.{proj}.weight", StackRow(j))
                        for j in range(args.experts)
                        for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
        return out

    def run_notes(self, args: MoEArgs, layout, device: torch.device) -> list[str]:
        # (each rank's experts: their hidden width split over tp)
        dtype = getattr(torch, layout.param_dtype)
        experts = args.experts // layout.ep
        how = how_experts_run(dtype, device, args.dim, args.moe_hidden // layout.tp, experts)
        return [f"experts: {experts} of {args.experts} per rank in each MoE block, run as "
                f"{how}"]

    def expert_slots(self, args: MoEArgs) -> int:
        return args.top_k

    def auxiliary_terms(self, args: MoEArgs) -> tuple[str, ...]:
        return (BALANCE_LOSS,) * bool(args.balance_coeff) + super().auxiliary_terms(args)

    def check_shape(self, args: MoEArgs) -> None:
        super().check_shape(args)
        if not 1 <= args.top_k <= args.experts:
            raise ValueError(f"model.top_k = {args.top_k} must be between 1 and model.experts = "
                             f"{args.experts}")
        if args.dense_layers > args.n_layers:
            raise ValueError(f"the flavour's {args.dense_layers} dense blocks exceed model.n_layers = "
                             f"{args.n_layers}")
        if args.score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score {args.score!r} is not 'softmax' or 'sigmoid'")
        groups, top = args.route_groups, args.route_top_groups
        if groups > 1 and (args.experts % groups or not 1 <= top <= groups
                           or args.top_k > top * (args.experts // groups)):
            raise ValueError(f"model.route_groups = {groups} with model.route_top_groups = {top}: the groups "
                             f"must divide model.experts = {args.experts}, the top groups be 1 to {groups}, "
                             f"and hold at least model.top_k = {args.top_k} experts")

    def sequence_terms(self, args: MoEArgs) -> tuple[str, ...]:
        # (the balance term and the capacity count each sequence's slots)
        return tuple(f for f in ("capacity_factor", "balance_coeff") if getattr(args, f))

    def tp_divisors(self, args: MoEArgs) -> dict[str, int]:
        shared = {"shared expert width": args.shared_hidden} if args.shared_hidden else {}
        return {**super().tp_divisors(args), "routed expert width": args.moe_hidden, **shared}

    def blocks_alone(self, args: MoEArgs, blocks: int) -> MoEArgs:
        # (the first blocks are the dense ones: a cut to fewer holds no routed block)
        return replace(super().blocks_alone(args, blocks), dense_layers=min(args.dense_layers, blocks))

    def blocks_params(self, args: MoEArgs, layers: range):
        dense = len(range(layers.start, min(layers.stop, args.dense_layers)))  # they come first
        return super().body_params(args) * dense + self.body_params(args) * (len(layers) - dense)

    def body_params(self, args: MoEArgs, layer: int | None = None):
        if layer is not None and layer < args.dense_layers:
            return super().body_params(args, layer)
        d, h, e = args.dim, args.moe_hidden, args.experts
        # (TP splits the shared experts like a dense SwiGLU, the routed ones along h: their columns)
        shared = [(f"feed_forward.shared.{w}.weight", shape, tp_dim) for w, shape, tp_dim in
                  (("w1", (args.shared_hidden, d), 0), ("w2", (d, args.shared_hidden), 1),
                   ("w3", (args.shared_hidden, d), 0))] if args.shared_hidden else []
        biases = [("feed_forward.experts.w1_bias", (e, h), 1), ("feed_forward.experts.w3_bias", (e, h), 1),
                  ("feed_forward.experts.w2_bias", (e, d), None)] if args.expert_biases else []
        return self.attention_params(args) + [
            ("ffn_norm.weight", (d, 1), None),
            ("feed_forward.router.gate.weight", (e, d), None),
            *([("feed_forward.router.gate.bias", (e, 1), None)] if args.expert_biases else []),
            ("feed_forward.experts.w1", (e, d * h), 1), ("feed_forward.experts.w3", (e, d * h), 1),
            ("feed_forward.experts.w2", (e, h * d), 1), *biases, *shared]

    def block_kind(self, args: MoEArgs, layer: int) -> tuple[bool, int]:
        return layer < args.dense_layers, super().block_kind(args, layer)

    def traced_args(self, args: MoEArgs, kind: tuple[bool, int] | None = None, tp: int = 1) -> MoEArgs:
        # A routed block (the largest kind) or a dense one, dropless: a routed block's activations
        # hold t x k expert rows whatever the routing. Each tp rank runs the routed module whole
        # with its share of the experts' and shared experts' hidden width (the planner leaves what
        # a routed module holds whole).
        dense, window = kind if kind is not None else (False, None)
        return replace(super().traced_args(args, window), dense_layers=int(dense), capacity_factor=0.0,
                       moe_hidden=args.moe_hidden // tp, shared_hidden=args.shared_hidden // tp)

    def param_counts(self, args: MoEArgs) -> dict[str, int]:
        counts = super().param_counts(args)
        dense = counts["layer"]

        def size(entries):
            return sum(r * c for _, (r, c), _ in entries)

        moe = size(self.body_params(args))
        experts = 3 * args.dim * args.moe_hidden
        active = moe - experts * (args.experts - args.top_k)
        n_moe = args.routed_blocks
        return {**counts, "layer": moe, "layers": dense * args.dense_layers + moe * n_moe,
                "active_layers": dense * args.dense_layers + active * n_moe,
                "active_layer": active, "depths": (moe + self.join_params(args)) * args.mtp_depth}

    @staticmethod
    def routed_vectors(args: MoEArgs) -> int:
        """A routed block's biases beyond a dense block's vectors: the router's, and every expert's
        (its active count holds them all)."""
        return args.experts * (1 + 2 * args.moe_hidden + args.dim) if args.expert_biases else 0

    def active_matmul_params(self, args: MoEArgs) -> int:
        """The matmul weights a token passes through in all blocks: the router, its k experts and
        the shared experts of each routed block, every weight of a dense one (norms and biases apart)."""
        return (self.param_counts(args)["active_layers"] - self.block_vectors(args) * args.n_layers
                - self.routed_vectors(args) * args.routed_blocks)

    def matmul_params(self, args: MoEArgs) -> tuple[int, int]:
        """(active matmul weights per block, averaged over the blocks; the head's)."""
        return self.active_matmul_params(args) // args.n_layers, args.vocab_size * args.dim

    def blocks_matmul(self, args: MoEArgs) -> int:
        # Active FLOPs: the router and the k chosen experts' (and shared experts') matmuls, not every
        # expert's (exact: matmul_params' mean per block rounds)
        return self.active_matmul_params(args)

    def depth_block_matmul(self, args: MoEArgs) -> int:
        return self.param_counts(args)["active_layer"] - self.block_vectors(args) - self.routed_vectors(args)

    def extra_state(self, args: MoEArgs) -> dict[str, tuple[int, ...]]:
        return {BIAS_STATE: (len(args.moe_layers), args.experts)}

    def routing(self, parts: list[nn.Module], args: MoEArgs) -> Routing:
        return Routing(parts, args)

    def routed_counts(self, args: MoEArgs) -> int:
        return len(args.moe_layers) * (args.experts + 2)


ADAPTER = MoEAdapter()
