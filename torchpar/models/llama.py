"""A Llama-3-style decoder you can read top to bottom.

RMSNorm, rotary position embedding (RoPE), grouped-query attention through
``F.scaled_dot_product_attention`` and a SwiGLU feed-forward. Single-device code: nothing here
knows about process groups. Parallel code finds modules by name (``layers.3.attention.wq``) and
may remove the embedding, layers or head (pipeline stages); the forward skips what is missing.

Shapes: b = batch, s = sequence, d = dim, h = local heads, hd = head_dim, v = vocab.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from torchpar.loss import add_auxiliary_loss, cross_entropy_sum, depth_term, targets_of, token_ids
from torchpar.models.common import (
    Documents,
    Mask,
    ModelAdapter,
    SeededInit,
    SwiGLU,
    attention,
    document_layout,
    local,
)


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    head_size: int = 0  # each attention head's width; 0 = dim / n_heads (Qwen3 sets it apart)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    attn_sink: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    attn_bias: bool = False  # biases on the q, k, v and output projections (gpt-oss, Qwen2)
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included; 0 = no layer slides
    full_attention_every: int = 2  # with a window, layers N-1, 2N-1, ... attend fully (gpt-oss: 2)
    yarn_factor: float = 0.0  # YaRN: RoPE's context stretched this many times (0 or 1 = plain RoPE)
    yarn_original_seq_len: int = 0  # the context RoPE was trained at, which YaRN stretches
    yarn_beta_fast: float = 32.0  # YaRN's ramp: rotations above this are kept (extrapolated) ...
    yarn_beta_slow: float = 1.0  # ... below this interpolated by the factor; between, blended
    yarn_truncate: bool = True  # the ramp's ends rounded to whole pairs (transformers' default; gpt-oss: not)
    # Multi-head latent attention (DeepSeek-V2/V3), on with kv_lora_rank > 0: keys and values come
    # from a per-token latent, queries from another (or from x); each q/k head is head_dim wide
    # without RoPE and qk_rope_dim wide with it, the rotary key one per token, shared by the heads.
    kv_lora_rank: int = 0  # the key/value latent's width (DeepSeek-V3: 512); 0 = grouped-query attention
    q_lora_rank: int = 0  # the query latent's width (DeepSeek-V3: 1536); 0 = queries projected from x
    qk_rope_dim: int = 0  # the rotary part of each q/k head (DeepSeek-V3: 64); 0 = head_dim / 2
    v_head_size: int = 0  # each value head's width (DeepSeek-V3: 128); 0 = head_dim
    # Multi-token prediction (DeepSeek-V3): depths after the last block, depth k predicting the token
    # k further ahead than the model's own prediction; trained beside it with weight mtp_weight / depths.
    mtp_depth: int = 0  # the prediction depths (DeepSeek-V3: 1); 0 = none
    mtp_weight: float = 0.3  # the depths' share of the loss (DeepSeek-V3: 0.3, later 0.1)

    @property
    def mtp_layers(self) -> range:
        """The indices of the prediction depths' blocks, after the model's own."""
        return range(self.n_layers, self.n_layers + self.mtp_depth)

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0 = it attends to every earlier key)."""
        if not self.sliding_window or (layer + 1) % self.full_attention_every == 0:
            return 0
        return self.sliding_window

    @property
    def head_dim(self) -> int:
        """Each head's width (under latent attention: its part without RoPE)."""
        return self.head_size or self.dim // self.n_heads

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (else grouped-query attention)."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates in each q/k head."""
        return (self.qk_rope_dim or self.head_dim // 2) if self.latent else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Each query and key head's width, the rotary part included."""
        return self.head_dim + self.rope_dim if self.latent else self.head_dim

    @property
    def v_head_dim(self) -> int:
        return (self.v_head_size or self.head_dim) if self.latent else self.head_dim

    @property
    def q_dim(self) -> int:
        """The query projection's width, n_heads x qk_head_dim (= dim unless head sizes are set)."""
        return self.n_heads * self.qk_head_dim

    @property
    def o_dim(self) -> int:
        """The output projection's input width, n_heads x v_head_dim."""
        return self.n_heads * self.v_head_dim

    @property
    def softmax_temperature(self) -> float:
        """YaRN's attention temperature, 0.1 ln(factor) + 1 (1 without YaRN): grouped-query
        attention scales cos and sin by it (so q.k by its square, gpt-oss's and Hugging Face's
        default); latent attention scales the whole score by its square (DeepSeek-V3's, whose
        rotary part is a third of the head)."""
        return 0.1 * math.log(self.yarn_factor) + 1.0 if self.yarn_factor > 1 else 1.0

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def to_dict(self) -> dict:
        return asdict(self)


# Tiny but shaped like the big ones: 8 layers (4 pipeline stages x 2), 8 heads and 4 KV heads
# (tp=4 divides both), vocab 4096 = the shipped tokenizer's.
DEBUG = ModelArgs(dim=128, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=64,
                  rope_theta=10000.0, max_seq_len=2048)
FLAVORS: dict[str, ModelArgs] = {
    "debug": DEBUG,
    "debug-tied": replace(DEBUG, tie_embeddings=True),
    # gpt-oss's attention on the debug shape: sinks, biases, a window in every other layer, YaRN
    "debug-gptoss": replace(DEBUG, attn_sink=True, attn_bias=True, sliding_window=16, yarn_factor=4.0,
                            yarn_original_seq_len=512),
    # multi-head latent attention on the debug shape, DeepSeek-V2-Lite's kind: keys and values from a
    # latent of 32, queries projected from x, heads of 16 + a rotary 8 (the MoE family's debug-deepseek
    # has DeepSeek-V3's, with a query latent)
    "debug-mla": replace(DEBUG, n_kv_heads=8, kv_lora_rank=32, qk_rope_dim=8),
    # GPT-3 Small's shape with SwiGLU and a padded GPT-2 vocabulary; tied like GPT-3.
    "125M": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=50304, multiple_of=256,
                      rope_theta=10000.0, max_seq_len=2048, tie_embeddings=True),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                    tie_embeddings=True),
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "405B": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096
    ),
    # GPT-3 175B as the tutorials size it: hidden 12288, 96 layers, 96 heads (full multi-head attention).
    "gpt3-175B": ModelArgs(dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, vocab_size=50304,
                           multiple_of=256, rope_theta=10000.0, max_seq_len=2048),
}


# ---------------------------------------------------------------- modules

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, hd/2] of each position's angle per pair of a head's rotated dims."""
    hd = args.rope_dim
    freqs = 1.0 / args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # [hd/2]
    if args.yarn_factor > 1:
        freqs = yarn(freqs, args)
    scale = 1.0 if args.latent else args.softmax_temperature  # (latent attention scales its scores)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)  # [s, hd/2]
    return angles.cos() * scale, angles.sin() * scale


def yarn(freqs: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """YaRN (Peng et al., 2023): the frequencies that turn fewer than ``beta_slow`` times over the
    original context are divided by the factor (interpolated), those that turn more than
    ``beta_fast`` times are kept, a linear ramp between (its temperature:
    ModelArgs.softmax_temperature)."""
    hd, factor = args.rope_dim, args.yarn_factor

    def pair_turning(turns: float) -> float:  # the pair index whose frequency turns ``turns`` times
        turning = math.log(args.yarn_original_seq_len / (turns * 2 * math.pi))
        return hd * turning / (2 * math.log(args.rope_theta))

    low, high = pair_turning(args.yarn_beta_fast), pair_turning(args.yarn_beta_slow)
    if args.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    kept = 1 - ramp  # 1: the pair keeps its frequency, 0: it is interpolated
    return freqs / factor * (1 - kept) + freqs * kept


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1) of each head by the position's angle. x: [b, s, h, hd];
    cos, sin: the tables [max_s, hd/2] (positions 0..s-1) or each token's row [b, s, hd/2]."""
    b, s, h, hd = x.shape
    if cos.dim() == 2:
        cos, sin = cos[:s].unsqueeze(0), sin[:s].unsqueeze(0)
    # As complex numbers (x0 + i x1) * e^(i angle): one multiplication kernel each way, where the
    # pairs' four real products, their sum and difference and the interleave took seven.
    turn = torch.complex(cos.float(), sin.float()).view(-1, s, 1, hd // 2)
    pairs = torch.view_as_complex(x.float().reshape(b, s, h, hd // 2, 2))
    return torch.view_as_real(pairs * turn).reshape(b, s, h, hd).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0):
        """``window``: the layer's sliding window (0 = none; ModelArgs.window)."""
        super().__init__()
        self.head_dim, self.window = args.head_dim, window
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.q_dim, bias=args.attn_bias)
        self.wk = nn.Linear(args.dim, kv_dim, bias=args.attn_bias)
        self.wv = nn.Linear(args.dim, kv_dim, bias=args.attn_bias)
        self.wo = nn.Linear(args.o_dim, args.dim, bias=args.attn_bias)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.attn_sink else None  # [h]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Mask = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [b, s, h, hd]
        k = self.wk(x).view(b, s, -1, self.head_dim)  # [b, s, h_kv, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        # mask: None = causal over the window, else kept inside documents (common.attention);
        # grouped-query heads are served inside the kernel, with no repeated copy of K and V.
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                        self.head_sinks(), self.window)  # [b, h, s, hd]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


    def head_sinks(self) -> torch.Tensor | None:
        """The sinks [h] of this rank's heads (under TP the split's local part), or None."""
        return local(self.sinks) if self.sinks is not None else None


# The latents' norms keep DeepSeek's own epsilon whatever the blocks' norm_eps (as its code and
# Hugging Face's build them).
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, DeepSeek-V3). Keys and values are projected up from
    a latent of kv_lora_rank per token (and queries from one of q_lora_rank, when set), each
    normalized; RoPE would not commute with the up-projection, so each q/k head carries a separate
    rotary part (rd wide) beside its unrotated part (hd wide), and the rotary key is one per token,
    shared by every head. Value heads are vd wide. A cache at inference keeps only the latent and the
    rotary key per token (kv_lora_rank + rd numbers): what this attention is for.

    Under tensor parallelism the heads are split (wq / wq_b, wkv_b column-wise, wo row-wise) and
    the latents replicated: every rank computes them whole from the same input, and each rank's
    heads add their share to the latents' gradients, summed over the ranks."""

    def __init__(self, args: ModelArgs, window: int = 0):
        super().__init__()
        self.window = window
        self.nope, self.rope, self.v_dim = args.head_dim, args.rope_dim, args.v_head_dim
        d, h, qk = args.dim, args.n_heads, args.qk_head_dim
        if args.q_lora_rank:
            self.wq, self.wq_a = None, nn.Linear(d, args.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, h * qk, bias=False)
        else:
            self.wq, self.wq_a, self.q_a_norm, self.wq_b = nn.Linear(d, h * qk, bias=False), None, None, None
        self.wkv_a = nn.Linear(d, args.kv_lora_rank, bias=False)
        self.kv_a_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.wk_rope = nn.Linear(d, self.rope, bias=False)  # the shared rotary key
        self.wo = nn.Linear(h * self.v_dim, d, bias=False)
        self.sinks = nn.Parameter(torch.empty(h)) if args.attn_sink else None  # [h]
        # DeepSeek-V3's YaRN temperature on the whole score: q scaled by its square
        self.q_scale = args.softmax_temperature ** 2

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Mask = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q = q.view(b, s, -1, self.nope + self.rope)  # [b, s, h, hd + rd]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(self.wkv_a(x))).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [b, s, h, hd], [b, s, h, vd]
        k_rope = apply_rope(self.wk_rope(x).unsqueeze(2), cos, sin)  # [b, s, 1, rd]: one per token
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # [b, s, h, hd + rd]
        # (attention's scale, 1/sqrt(hd + rd), is the query's width's)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                        self.head_sinks(), self.window)  # [b, h, s, vd]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    head_sinks = Attention.head_sinks


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, feed_forward: nn.Module | None = None, layer: int = 0):
        """``feed_forward``: what replaces the dense SwiGLU (a mixture of experts), if anything;
        ``layer``: the block's index (which says whether its attention slides)."""
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = (LatentAttention if args.latent else Attention)(args, args.window(layer))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward if feed_forward is not None else SwiGLU(args.dim, args.ffn_hidden)
        # A prediction depth's block has both (Transformer.depth_block); the model's own, neither.
        self.join: DepthJoin | None = None  # its input: the previous depth's state and a token's embedding
        self.final_norm: RMSNorm | None = None  # its norm before the shared head

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None):
        """x [b, s, d] -> [b, s, d]; a prediction depth's block: x [b, s, 2d] -> (its state [b, s, d],
        that state normalized for the head)."""
        if self.join is not None:
            x = self.join(x)
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out if self.final_norm is None else (out, self.final_norm(out))


class DepthJoin(nn.Module):
    """The input of a multi-token prediction depth (DeepSeek-V3): the previous depth's hidden state
    and the embedding of the token this depth reads, each normalized, projected together to d."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)  # the token's embedding
        self.hnorm = RMSNorm(args.dim, args.norm_eps)  # the previous depth's state
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, e = x.chunk(2, dim=-1)  # [b, s, 2d]: the state, then the embedding
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))


class Transformer(SeededInit):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the global layer index, so a pipeline stage keeps its layers' names.
        self.layers = nn.ModuleDict({str(i): self.block(args, i) for i in range(args.n_layers)})
        self.layers.update({str(i): self.depth_block(args, i) for i in args.mtp_layers})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def block(self, args: ModelArgs, layer: int) -> nn.Module:
        """Block ``layer`` (a family built on this one changes its feed-forward here)."""
        return TransformerBlock(args, layer=layer)

    def depth_block(self, args: ModelArgs, layer: int) -> nn.Module:
        """A prediction depth's block: a block like the model's last, with a join and a final norm."""
        block = self.block(args, layer)
        block.join, block.final_norm = DepthJoin(args), RMSNorm(args.dim, args.norm_eps)
        return block

    def block_args(self, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What every block takes after the hidden states: the RoPE tables, or for given
        positions [b, s] each token's row of them [b, s, hd/2]."""
        if positions is None:
            return self.rope_cos, self.rope_sin
        return self.rope_cos[positions], self.rope_sin[positions]

    def tie_weights(self) -> None:
        """Share the embedding table with the head (when tied and both are here). Moving a meta
        model to a device or sharding it can replace the parameter objects, so callers re-tie."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor, documents: Documents = None, ahead: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x: token ids [b, s] on the first stage, hidden states [b, s, d] after it. documents:
        each token's document [b, s] to keep attention inside (positions restart per document).
        ahead: in training with prediction depths, each position's next tokens [b, s, depths + 1]
        (:func:`torchpar.loss.tokens_ahead`); the depths' embeddings then travel with the hidden
        states between pipeline stages ([b, s, (depths + 1) d]) to the last, which holds the depths."""
        depths = self.args.mtp_depth if ahead is not None else 0
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)  # [b, s, d]
            # each [b, s, d] (a position past the window or its document reads token 0: its target is ignored)
            read = [self.tok_embeddings(token_ids(ahead[..., k]).clamp(min=0)) for k in range(depths)]
        else:
            h, *read = x.chunk(depths + 1, dim=-1) if depths else (x,)
        positions, mask = (document_layout(documents, h.dtype, h.device) if documents is not None
                           else (None, None))
        block_args = self.block_args(positions)
        for key, layer in self.layers.items():
            if int(key) < self.args.n_layers:
                h = layer(h, *block_args, mask)
        if self.output is None:  # (a stage before the last)
            return torch.cat([h, *read], dim=-1) if depths else h
        if depths:
            h = self._predict_ahead(h, read, ahead, block_args, mask)
        return self.output(self.norm(h))  # [b, s, v] logits

    def _predict_ahead(self, h: torch.Tensor, read: list[torch.Tensor], ahead: torch.Tensor, block_args,
                       mask: Mask) -> torch.Tensor:
        """``h`` with each prediction depth's cross-entropy joined to the loss: depth k runs its
        block over the previous depth's state (the model's own for depth 1) and the embedding of
        token i + k, and the shared head predicts token i + k + 1 (``ahead[..., k]``)."""
        state, weight = h, self.args.mtp_weight / self.args.mtp_depth
        for k, (layer, embedded) in enumerate(zip(self.args.mtp_layers, read), 1):
            state, normed = self.layers[str(layer)](torch.cat([state, embedded], dim=-1), *block_args, mask)
            ce = cross_entropy_sum(self.output(normed), targets_of(ahead[..., k]))
            h = add_auxiliary_loss(h, depth_term(k), ce, weight)
        return h

    # ------------------------------------------------------------ initialization

    def init_std(self, name: str) -> float | str:
        if name.endswith("norm.weight"):
            return "ones"
        if name == "tok_embeddings.weight":
            return self.args.dim ** -0.5 if self.args.tie_embeddings else 1.0
        if name == "output.weight":
            return self.args.dim ** -0.5
        if name.endswith(".bias"):  # (the projections' biases: start as none)
            return "zeros"
        if name.endswith("attention.sinks"):  # logits beside the scores, which start near N(0, 1)
            return 1.0
        if name.endswith(("wo.weight", "w2.weight")):  # residual projections, scaled with depth
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02

    def reset_buffers(self, device: torch.device | None) -> None:
        cos, sin = rope_tables(self.args)
        device = device if device is not None else self.rope_cos.device
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)


# ---------------------------------------------------------------- the adapter


class LlamaAdapter(ModelAdapter):
    name = "llama3"
    model_class = Transformer
    args_class = ModelArgs
    flavors = FLAVORS
    first_stage = ("tok_embeddings",)
    last_stage = ("norm", "output")
    # Megatron's split: q/k/v and the SwiGLU inputs column-wise (each rank its share of heads and
    # hidden units), wo and w2 row-wise; embedding and head vocab-sharded.
    top_plan = {"tok_embeddings": "embedding", "norm": "norm", "output": "head"}
    attention_plan = {"attention_norm": "norm", "attention": "input", "attention.wq": "colwise",
                      "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
                      "attention.q_norm": "head_norm", "attention.k_norm": "head_norm",
                      "attention.sinks": "heads"}
    # Latent attention: the heads split as above; the latents (and the shared rotary key) computed
    # whole on every rank, their gradients summed over the ranks' heads.
    latent_plan = {"attention_norm": "norm", "attention": "input", "attention.wq": "colwise",
                   "attention.wq_a": "replicated", "attention.q_a_norm": "latent",
                   "attention.wq_b": "colwise", "attention.wkv_a": "replicated",
                   "attention.kv_a_norm": "latent", "attention.wkv_b": "colwise",
                   "attention.wk_rope": "shared", "attention.wo": "rowwise", "attention.sinks": "heads"}
    feed_forward_plan = {"ffn_norm": "norm", "feed_forward": "input", "feed_forward.w1": "colwise",
                         "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise"}
    block_plan = {**attention_plan, **feed_forward_plan}
    # A prediction depth's own modules work token by token: whole on every rank (under sequence
    # parallelism each on its own tokens).
    depth_plan = {"join.enorm": "token_wise", "join.hnorm": "token_wise", "join.eh_proj": "token_wise",
                  "final_norm": "token_wise"}

    def attention_words(self, args: ModelArgs) -> dict[str, str]:
        """The plan of a block's attention and its norm. (With a query latent, every module that
        takes the attention's input runs whole: its gradient comes back summed.)"""
        if not args.latent:
            return self.attention_plan
        return {**self.latent_plan, "attention": "whole_input"} if args.q_lora_rank else self.latent_plan

    def feed_forward_words(self, args: ModelArgs, layer: int) -> dict[str, str]:
        """The plan of block ``layer``'s feed-forward and its norm."""
        return self.feed_forward_plan

    def layer_plan(self, args: ModelArgs, layer: int) -> dict[str, str]:
        depth = self.depth_plan if layer >= args.n_layers else {}
        return {**self.attention_words(args), **self.feed_forward_words(args, layer), **depth}

    def auxiliary_terms(self, args: ModelArgs) -> tuple[str, ...]:
        return tuple(depth_term(k) for k in range(1, args.mtp_depth + 1))

    def prediction_depths(self, args: ModelArgs) -> int:
        return args.mtp_depth

    def blocks_alone(self, args: ModelArgs, blocks: int) -> ModelArgs:
        return replace(args, n_layers=blocks, mtp_depth=0)

    hf_architecture = "LlamaForCausalLM"
    hf_qk_norm = False  # whether the HF class has per-head q/k norms (Llama's has not; Qwen3's have)

    def hf_config(self, args: ModelArgs) -> dict:
        # RoPE as both transformers generations spell it: rope_theta and rope_scaling (4.x),
        # rope_parameters (5.x).
        rope = self._hf_rope(args)
        return {"architectures": [self.hf_architecture], "model_type": "llama", "hidden_size": args.dim,
                "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
                "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
                "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rope_theta": args.rope_theta,
                "rope_parameters": {"rope_theta": args.rope_theta, **rope},
                "rope_scaling": rope if args.yarn_factor > 1 else None,
                "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
                "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
                "attention_bias": args.attn_bias, "mlp_bias": False}

    @staticmethod
    def _hf_rope(args: ModelArgs) -> dict:
        if not args.yarn_factor > 1:
            return {"rope_type": "default"}
        return {"rope_type": "yarn", "factor": args.yarn_factor, "beta_fast": args.yarn_beta_fast,
                "beta_slow": args.yarn_beta_slow,
                "original_max_position_embeddings": args.yarn_original_seq_len,
                **({} if args.yarn_truncate else {"truncate": False})}

    def hf_tensors(self, args: ModelArgs) -> list[tuple[str, str, int | None]]:
        out = [("tok_embeddings.weight", "model.embed_tokens.weight", None)]
        for i in range(args.n_layers):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            out += [
                (f"layers.{i}.attention_norm.weight", f"model.layers.{i}.input_layernorm.weight", None),
                (f"layers.{i}.attention.wq.weight", f"{a}.q_proj.weight", args.n_heads),
                (f"layers.{i}.attention.wk.weight", f"{a}.k_proj.weight", args.n_kv_heads),
                (f"layers.{i}.attention.wv.weight", f"{a}.v_proj.weight", None),
                (f"layers.{i}.attention.wo.weight", f"{a}.o_proj.weight", None),
                # (a per-head norm's weight: permuted within its one head, as the rows of q and k)
                *([(f"layers.{i}.attention.q_norm.weight", f"{a}.q_norm.weight", 1),
                   (f"layers.{i}.attention.k_norm.weight", f"{a}.k_norm.weight", 1)] if args.qk_norm else []),
                *([(f"layers.{i}.attention.wq.bias", f"{a}.q_proj.bias", args.n_heads),
                   (f"layers.{i}.attention.wk.bias", f"{a}.k_proj.bias", args.n_kv_heads),
                   (f"layers.{i}.attention.wv.bias", f"{a}.v_proj.bias", None),
                   (f"layers.{i}.attention.wo.bias", f"{a}.o_proj.bias", None)] if args.attn_bias else []),
                (f"layers.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight", None),
                (f"layers.{i}.feed_forward.w1.weight", f"{m}.gate_proj.weight", None),
                (f"layers.{i}.feed_forward.w2.weight", f"{m}.down_proj.weight", None),
                (f"layers.{i}.feed_forward.w3.weight", f"{m}.up_proj.weight", None),
            ]
        out.append(("norm.weight", "model.norm.weight", None))
        if not args.tie_embeddings:
            out.append(("output.weight", "lm_head.weight", None))
        return out

    def to_hf(self, t: torch.Tensor, heads) -> torch.Tensor:
        """torchpar rotates consecutive pairs (x0, x1) of a head; HF rotates x[i] with
        x[i + hd/2]. Within each head, HF's rows are torchpar's even rows, then its odd rows (a
        vector, e.g. a per-head norm's weight, is one column)."""
        if not isinstance(heads, int):
            return super().to_hf(t, heads)
        if t.dim() == 1:
            return self.to_hf(t[:, None], heads)[:, 0]
        rows, cols = t.shape
        return t.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    def from_hf(self, t: torch.Tensor, heads) -> torch.Tensor:
        if not isinstance(heads, int):
            return super().from_hf(t, heads)
        if t.dim() == 1:
            return self.from_hf(t[:, None], heads)[:, 0]
        rows, cols = t.shape
        return t.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)

    def check_shape(self, args: ModelArgs) -> None:
        super().check_shape(args)
        if args.latent:
            unlike = [f for f, on in (("attn_bias", args.attn_bias), ("qk_norm", args.qk_norm)) if on]
            if unlike:
                raise ValueError(f"model.{unlike[0]} with model.kv_lora_rank (latent attention): its "
                                 "latents' norms take the place of q/k norms and it has no biases; unset one")
            if args.n_kv_heads != args.n_heads:
                raise ValueError(f"model.n_kv_heads = {args.n_kv_heads} with model.kv_lora_rank: latent "
                                 f"attention gives every query head its own key and value head; set "
                                 f"n_kv_heads = n_heads = {args.n_heads}")
            if args.rope_dim % 2 or args.rope_dim < 2:
                raise ValueError(f"model.qk_rope_dim = {args.rope_dim}: RoPE rotates pairs, so an even width")
            if args.v_head_dim > args.qk_head_dim:
                raise ValueError(f"model.v_head_size = {args.v_head_dim} is wider than a query head "
                                 f"({args.qk_head_dim} = head size + qk_rope_dim); attention kernels take "
                                 "value heads at most as wide")
        if args.yarn_factor and not args.yarn_factor >= 1:
            raise ValueError(f"model.yarn_factor = {args.yarn_factor}: YaRN stretches the context, so the "
                             "factor is at least 1 (0 = plain RoPE)")
        if args.yarn_factor > 1 and args.yarn_original_seq_len < 2:
            raise ValueError("model.yarn_factor needs model.yarn_original_seq_len, the context RoPE was "
                             "trained at (gpt-oss: 4096)")
        if not 0 <= args.mtp_depth <= min(args.n_layers, args.max_seq_len - 1):
            raise ValueError(f"model.mtp_depth = {args.mtp_depth}: 0 (none) to model.n_layers = "
                             f"{args.n_layers} prediction depths (each one more block and head pass)")
        if args.sliding_window and args.full_attention_every < 1:
            raise ValueError(f"model.full_attention_every = {args.full_attention_every}: every N-th layer "
                             "attends fully, N >= 1")

    def hf_problem(self, args: ModelArgs) -> str | None:
        if args.qk_norm and not self.hf_qk_norm:
            return f"model.qk_norm: {self.hf_architecture} has no per-head query/key norms (Qwen3's have)"
        if args.latent:
            return f"model.kv_lora_rank: {self.hf_architecture} has no latent attention"
        if args.attn_sink:
            return f"model.attn_sink: {self.hf_architecture} has no attention sinks"
        if args.sliding_window:
            return f"model.sliding_window: {self.hf_architecture} has no sliding-window layers"
        if args.mtp_depth:
            return f"model.mtp_depth: {self.hf_architecture} has no multi-token prediction layers"
        return super().hf_problem(args)

    def attention_keys(self, args: ModelArgs, seq_len: int) -> int:
        # A layer sliding a window of w keys counts min(s, 2w): twice the band's keys, as the full
        # square counts causal attention's half twice.
        windows = (args.window(i) for i in range(args.n_layers + args.mtp_depth))
        return sum(min(seq_len, 2 * w) if w else seq_len for w in windows)

    def block_kind(self, args: ModelArgs, layer: int) -> int:
        return args.window(layer)  # (a sliding layer holds its mask, a full one none)

    def traced_args(self, args: ModelArgs, kind: int | None = None, tp: int = 1) -> ModelArgs:
        one = self.blocks_alone(args, 1)  # (its block 0 slides where the model has windows)
        if kind is None or kind == one.window(0):
            return one
        return replace(one, sliding_window=kind, full_attention_every=2)  # (layer 0 slides, with a window)

    def custom_attention(self, args: ModelArgs) -> tuple[str, ...]:
        return ("attn_sink",) * args.attn_sink + ("sliding_window",) * bool(args.sliding_window)

    def attention_heads(self, args: ModelArgs) -> tuple[int, int, int, int]:
        return args.n_heads, args.n_kv_heads, args.qk_head_dim, args.v_head_dim

    def tp_divisors(self, args: ModelArgs) -> dict[str, int]:
        return {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "ffn hidden size": args.ffn_hidden,
                "vocab_size": args.vocab_size}

    def stage_params(self, args: ModelArgs, first: bool, last: bool, layers: range):
        d = args.dim
        out = [("tok_embeddings.weight", (args.vocab_size, d), 0)] if first else []
        out += self.blocks_params(args, layers)
        if last:  # (the prediction depths' blocks live with the head)
            out += [entry for layer in args.mtp_layers for entry in self.block_params(args, layer)]
            out.append(("norm.weight", (d, 1), None))
            if not (args.tie_embeddings and first):
                out.append(("output.weight", (args.vocab_size, d), 0))
        return out

    def blocks_params(self, args: ModelArgs, layers: range):
        """The entries of blocks ``layers``, in order (the planner asks for them often: one list
        repeated, not one built per block)."""
        return self.body_params(args) * len(layers)

    def block_params(self, args: ModelArgs, layer: int | None = None):
        body = self.body_params(args, layer)
        return body + self.depth_params(args) if layer is not None and layer >= args.n_layers else body

    def depth_params(self, args: ModelArgs):
        """A prediction depth's entries after its block's: its join and its final norm (whole on
        every tp rank)."""
        d = args.dim
        return [("join.enorm.weight", (d, 1), None), ("join.hnorm.weight", (d, 1), None),
                ("join.eh_proj.weight", (d, 2 * d), None), ("final_norm.weight", (d, 1), None)]

    def body_params(self, args: ModelArgs, layer: int | None = None):
        """Block ``layer``'s entries without a prediction depth's own (None: the largest block)."""
        return self.attention_params(args) + [
            ("ffn_norm.weight", (args.dim, 1), None),
            ("feed_forward.w1.weight", (args.ffn_hidden, args.dim), 0),
            ("feed_forward.w2.weight", (args.dim, args.ffn_hidden), 1),
            ("feed_forward.w3.weight", (args.ffn_hidden, args.dim), 0)]

    def attention_params(self, args: ModelArgs):
        """A block's entries up to its feed-forward: the attention and its norms."""
        d, q, kv = args.dim, args.q_dim, args.n_kv_heads * args.head_dim
        # (the attention's own parameter, the sinks, comes before its modules' in model order)
        sinks = [("attention.sinks", (args.n_heads, 1), 0)] if args.attn_sink else []
        if args.latent:
            ql, kvl, h = args.q_lora_rank, args.kv_lora_rank, args.n_heads
            queries = ([("attention.wq_a.weight", (ql, d), None),
                        ("attention.q_a_norm.weight", (ql, 1), None), ("attention.wq_b.weight", (q, ql), 0)]
                       if ql else [("attention.wq.weight", (q, d), 0)])
            return [("attention_norm.weight", (d, 1), None), *sinks, *queries,
                    ("attention.wkv_a.weight", (kvl, d), None),
                    ("attention.kv_a_norm.weight", (kvl, 1), None),
                    ("attention.wkv_b.weight", (h * (args.head_dim + args.v_head_dim), kvl), 0),
                    ("attention.wk_rope.weight", (args.rope_dim, d), None),
                    ("attention.wo.weight", (d, args.o_dim), 1)]
        norms = [("attention.q_norm.weight", (args.head_dim, 1), None),
                 ("attention.k_norm.weight", (args.head_dim, 1), None)] if args.qk_norm else []
        q_bias, k_bias, v_bias, o_bias = ([(f"attention.w{n}.bias", (rows, 1), split)]
                                          if args.attn_bias else []
                                          for n, rows, split in (("q", q, 0), ("k", kv, 0), ("v", kv, 0),
                                                                 ("o", d, None)))
        return [("attention_norm.weight", (d, 1), None), *sinks,
                ("attention.wq.weight", (q, d), 0), *q_bias, ("attention.wk.weight", (kv, d), 0), *k_bias,
                ("attention.wv.weight", (kv, d), 0), *v_bias, ("attention.wo.weight", (d, q), 1), *o_bias,
                *norms]

    def param_counts(self, args: ModelArgs) -> dict[str, int]:
        d = args.dim
        attention = sum(r * c for _, (r, c), _ in self.attention_params(args)) - d  # (the norm apart)
        ffn = 3 * d * args.ffn_hidden  # w1, w2, w3
        layer = attention + ffn + 2 * d  # + attention_norm, ffn_norm
        return {"embedding": args.vocab_size * d, "layer": layer, "layer_attention": attention,
                "layer_ffn": ffn, "layers": layer * args.n_layers, "norm": d,
                "output": 0 if args.tie_embeddings else args.vocab_size * d,
                "depths": (layer + self.join_params(args)) * args.mtp_depth}

    def join_params(self, args: ModelArgs, matrices: bool = False) -> int:
        """A prediction depth's parameters beside its block (:meth:`depth_params`: its join's and its
        final norm's); ``matrices``: only those that multiply an activation (the join's projection)."""
        return sum(r * c for _, (r, c), _ in self.depth_params(args) if c > 1 or not matrices)

    def block_vectors(self, args: ModelArgs) -> int:
        """A block's parameters that multiply no activation: its norms' weights, its heads' sinks,
        its projections' biases."""
        biases = (args.q_dim + 2 * args.n_kv_heads * args.head_dim + args.dim) * args.attn_bias
        latents = (args.q_lora_rank + args.kv_lora_rank) * args.latent  # (their norms)
        return (2 * args.dim + 2 * args.head_dim * args.qk_norm + args.n_heads * args.attn_sink + biases
                + latents)

    def matmul_params(self, args: ModelArgs) -> tuple[int, int]:
        return self.param_counts(args)["layer"] - self.block_vectors(args), args.vocab_size * args.dim

    def matmul_weights(self, args: ModelArgs) -> int:
        # (each prediction depth: its block's, its join's projection, the head once more)
        head = self.matmul_params(args)[1]
        depth = self.depth_block_matmul(args) + self.join_params(args, matrices=True) + head
        return self.blocks_matmul(args) + head + depth * args.mtp_depth

    def depth_block_matmul(self, args: ModelArgs) -> int:
        """... in a prediction depth's block (one like the last block)."""
        return self.matmul_params(args)[0]


ADAPTER = LlamaAdapter()
