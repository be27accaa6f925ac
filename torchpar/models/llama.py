"""A Llama-3-style decoder you can read top to bottom.

RMSNorm, rotary position embedding (RoPE), grouped-query attention through
``F.scaled_dot_product_attention`` and a SwiGLU feed-forward. Single-device code: nothing here
knows about process groups. Parallel code finds modules by name (``layers.3.attention.wq``) and
may remove the embedding, layers or head (pipeline stages); the forward skips what is missing.

Shapes: b = batch, s = sequence, d = dim, h = local heads, hd = head_dim, v = vocab.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def to_dict(self) -> dict:
        return asdict(self)


FLAVORS: dict[str, ModelArgs] = {
    # Tiny but shaped like the big ones: 8 layers (4 pipeline stages x 2), 8 heads and 4 KV heads
    # (tp=4 divides both), vocab 4096 = the shipped tokenizer's.
    "debug": ModelArgs(dim=128, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=64,
                       rope_theta=10000.0, max_seq_len=2048),
    "debug-tied": ModelArgs(dim=128, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=64,
                            rope_theta=10000.0, max_seq_len=2048, tie_embeddings=True),
    # GPT-3 Small's shape with SwiGLU and a padded GPT-2 vocabulary; tied like GPT-3.
    "125M": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=50304, multiple_of=256,
                      rope_theta=10000.0, max_seq_len=2048, tie_embeddings=True),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                    tie_embeddings=True),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096),
    # The seeds' GPT-3 175B: hidden 12288, 96 layers, 96 heads (full multi-head attention).
    "gpt3-175B": ModelArgs(dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, vocab_size=50304, multiple_of=256,
                           rope_theta=10000.0, max_seq_len=2048),
}


def model_args(flavor: str, n_layers: int = 0) -> ModelArgs:
    """The flavour's args, with an optional layer-count override."""
    args = FLAVORS[flavor]
    return replace(args, n_layers=n_layers) if n_layers else args


# ---------------------------------------------------------------- counting (one source of truth)

def param_counts(args: ModelArgs) -> dict[str, int]:
    """Parameters per part; the planner and the trainer both use these."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    attention = d * d + 2 * d * kv + d * d  # wq, wk, wv, wo
    ffn = 3 * d * args.ffn_hidden  # w1, w2, w3
    layer = attention + ffn + 2 * d  # + attention_norm, ffn_norm
    embedding = args.vocab_size * d
    return {
        "embedding": embedding,
        "layer": layer,
        "layer_attention": attention,
        "layer_ffn": ffn,
        "layers": layer * args.n_layers,
        "norm": d,
        "output": 0 if args.tie_embeddings else args.vocab_size * d,
    }


def num_params(args: ModelArgs) -> int:
    c = param_counts(args)
    return c["embedding"] + c["layers"] + c["norm"] + c["output"]


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token: 3 x forward (backward = 2 x forward).

    Forward = 2 FLOPs per multiply-accumulate of every matmul weight (the embedding lookup is
    no matmul; the output head is, tied or not) + attention scores and values, 2 x 2 x s x d per
    layer, counted over the full s x s square as PaLM's appendix does (causal masking is ignored).
    """
    c = param_counts(args)
    matmul_weights = c["layers"] - 2 * args.dim * args.n_layers + args.vocab_size * args.dim
    attention = 4 * seq_len * args.dim * args.n_layers
    return 3 * (2 * matmul_weights + attention)


# ---------------------------------------------------------------- modules

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)  # [s, hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1) of each head by the position's angle. x: [b, s, h, hd]."""
    b, s, h, hd = x.shape
    pairs = x.float().view(b, s, h, hd // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, sn = cos[:s].view(1, s, 1, hd // 2), sin[:s].view(1, s, 1, hd // 2)
    out = torch.stack((x0 * c - x1 * sn, x0 * sn + x1 * c), dim=-1)
    return out.view(b, s, h, hd).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: under tensor parallelism each rank holds only its share of the heads.
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)  # [b, s, h, hd]
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)  # [b, s, h_kv, hd]
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, hd]
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # grouped-query attention: each KV head serves n_rep query heads
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, s, hd]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the global layer index, so a pipeline stage keeps its layers' names.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding table with the head (when tied and both are here). Moving a meta
        model to a device or sharding it can replace the parameter objects, so callers re-tie."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: token ids [b, s] on the first stage, hidden states [b, s, d] after it."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # [b, s, d]
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h  # [b, s, v] logits

    # ------------------------------------------------------------ initialization

    def init_std(self, name: str) -> float | None:
        """Std of the normal init of a parameter by its canonical name; None = ones (norms)."""
        if name.endswith("norm.weight"):
            return None
        if name == "tok_embeddings.weight":
            return self.args.dim ** -0.5 if self.args.tie_embeddings else 1.0
        if name == "output.weight":
            return self.args.dim ** -0.5
        if name.endswith(("wo.weight", "w2.weight")):  # residual projections, scaled with depth
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02

    def initial_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The full initial value of one parameter, a function of (seed, name) alone, so any
        split or sharding of the model starts from the same numbers as the whole model."""
        std = self.init_std(name)
        if std is None:
            return torch.ones(shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen).mul_(std)

    @torch.no_grad()
    def init_weights(self, seed: int, local_part=None, buffer_device: torch.device | None = None,
                     values: dict[str, torch.Tensor] | None = None) -> None:
        """Fill every parameter deterministically and recompute the RoPE tables.

        ``local_part(param, full) -> (dst, src)`` lets parallel code map the full value onto the
        piece of a sharded parameter that this process holds; by default the whole tensor.
        ``values`` (full tensors by canonical name, e.g. exported weights) replaces the random init.
        """
        for name, p in self.named_parameters():
            name = canonical_name(name)
            full = values[name] if values is not None else self.initial_value(name, tuple(p.shape), seed)
            dst, src = local_part(p, full) if local_part is not None else (p, full)
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)


def canonical_name(name: str) -> str:
    """Drop wrapper segments (activation checkpoint, compile, FSDP) that start with '_'."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))
