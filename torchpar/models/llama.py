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

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0 = it attends to every earlier key)."""
        if not self.sliding_window or (layer + 1) % self.full_attention_every == 0:
            return 0
        return self.sliding_window

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """The query projection's width, n_heads x head_dim (= dim unless head_size is set)."""
        return self.n_heads * self.head_dim

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
    """cos and sin [max_seq_len, hd/2] of each position's angle per pair of a head's dims."""
    hd = args.head_dim
    freqs = 1.0 / args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # [hd/2]
    scale = 1.0
    if args.yarn_factor > 1:
        freqs, scale = yarn(freqs, args)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)  # [s, hd/2]
    return angles.cos() * scale, angles.sin() * scale


def yarn(freqs: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): the frequencies that turn fewer than ``beta_slow`` times over the
    original context are divided by the factor (interpolated), those that turn more than
    ``beta_fast`` times are kept, a linear ramp between; and the attention temperature, applied to
    cos and sin (so to both q and k): 0.1 ln(factor) + 1."""
    hd, factor = args.head_dim, args.yarn_factor

    def pair_turning(turns: float) -> float:  # the pair index whose frequency turns ``turns`` times
        turning = math.log(args.yarn_original_seq_len / (turns * 2 * math.pi))
        return hd * turning / (2 * math.log(args.rope_theta))

    low = max(math.floor(pair_turning(args.yarn_beta_fast)), 0)
    high = min(math.ceil(pair_turning(args.yarn_beta_slow)), hd - 1)
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    kept = 1 - ramp  # 1: the pair keeps its frequency, 0: it is interpolated
    return freqs / factor * (1 - kept) + freqs * kept, 0.1 * math.log(factor) + 1.0


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
        self.wo = nn.Linear(args.q_dim, args.dim, bias=args.attn_bias)
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


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, feed_forward: nn.Module | None = None, layer: int = 0):
        """``feed_forward``: what replaces the dense SwiGLU (a mixture of experts), if anything;
        ``layer``: the block's index (which says whether its attention slides)."""
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, args.window(layer))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward if feed_forward is not None else SwiGLU(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Mask = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(SeededInit):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the global layer index, so a pipeline stage keeps its layers' names.
        self.layers = nn.ModuleDict({str(i): self.block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def block(self, args: ModelArgs, layer: int) -> nn.Module:
        """Block ``layer`` (a family built on this one changes its feed-forward here)."""
        return TransformerBlock(args, layer=layer)

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

    def forward(self, x: torch.Tensor, documents: Documents = None) -> torch.Tensor:
        """x: token ids [b, s] on the first stage, hidden states [b, s, d] after it. documents:
        each token's document [b, s] to keep attention inside (positions restart per document)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # [b, s, d]
        positions, mask = (document_layout(documents, h.dtype, h.device) if documents is not None
                           else (None, None))
        block_args = self.block_args(positions)
        for layer in self.layers.values():
            h = layer(h, *block_args, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h  # [b, s, v] logits

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
    block_plan = {"attention_norm": "norm", "attention": "input", "attention.wq": "colwise",
                  "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
                  "attention.q_norm": "head_norm", "attention.k_norm": "head_norm",
                  "attention.sinks": "heads",
                  "ffn_norm": "norm", "feed_forward": "input", "feed_forward.w1": "colwise",
                  "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise"}

    hf_architecture = "LlamaForCausalLM"

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
                "original_max_position_embeddings": args.yarn_original_seq_len}

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
        if args.yarn_factor and not args.yarn_factor >= 1:
            raise ValueError(f"model.yarn_factor = {args.yarn_factor}: YaRN stretches the context, so the "
                             "factor is at least 1 (0 = plain RoPE)")
        if args.yarn_factor > 1 and args.yarn_original_seq_len < 2:
            raise ValueError("model.yarn_factor needs model.yarn_original_seq_len, the context RoPE was "
                             "trained at (gpt-oss: 4096)")
        if args.sliding_window and args.full_attention_every < 1:
            raise ValueError(f"model.full_attention_every = {args.full_attention_every}: every N-th layer "
                             "attends fully, N >= 1")

    def hf_problem(self, args: ModelArgs) -> str | None:
        if args.attn_sink:
            return f"model.attn_sink: {self.hf_architecture} has no attention sinks"
        if args.sliding_window:
            return f"model.sliding_window: {self.hf_architecture} has no sliding-window layers"
        return super().hf_problem(args)

    def attention_keys(self, args: ModelArgs, seq_len: int) -> int:
        # A layer sliding a window of w keys counts min(s, 2w): twice the band's keys, as the full
        # square counts causal attention's half twice.
        windows = (args.window(i) for i in range(args.n_layers))
        return sum(min(seq_len, 2 * w) if w else seq_len for w in windows)

    def custom_attention(self, args: ModelArgs) -> tuple[str, ...]:
        return ("attn_sink",) * args.attn_sink + ("sliding_window",) * bool(args.sliding_window)

    def tp_divisors(self, args: ModelArgs) -> dict[str, int]:
        return {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "ffn hidden size": args.ffn_hidden,
                "vocab_size": args.vocab_size}

    def stage_params(self, args: ModelArgs, first: bool, last: bool, layers: range):
        d = args.dim
        out = [("tok_embeddings.weight", (args.vocab_size, d), 0)] if first else []
        out += self.blocks_params(args, layers)
        if last:
            out.append(("norm.weight", (d, 1), None))
            if not (args.tie_embeddings and first):
                out.append(("output.weight", (args.vocab_size, d), 0))
        return out

    def blocks_params(self, args: ModelArgs, layers: range):
        """The entries of blocks ``layers``, in order (the planner asks for them often: one list
        repeated, not one built per block)."""
        return self.block_params(args) * len(layers)

    def block_params(self, args: ModelArgs, layer: int | None = None):
        return self.attention_params(args) + [
            ("ffn_norm.weight", (args.dim, 1), None),
            ("feed_forward.w1.weight", (args.ffn_hidden, args.dim), 0),
            ("feed_forward.w2.weight", (args.dim, args.ffn_hidden), 1),
            ("feed_forward.w3.weight", (args.ffn_hidden, args.dim), 0)]

    def attention_params(self, args: ModelArgs):
        """A block's entries up to its feed-forward: the attention and its norms."""
        d, q, kv = args.dim, args.q_dim, args.n_kv_heads * args.head_dim
        norms = [("attention.q_norm.weight", (args.head_dim, 1), None),
                 ("attention.k_norm.weight", (args.head_dim, 1), None)] if args.qk_norm else []
        sinks = [("attention.sinks", (args.n_heads, 1), 0)] if args.attn_sink else []
        q_bias, k_bias, v_bias, o_bias = ([(f"attention.w{n}.bias", (rows, 1), split)]
                                          if args.attn_bias else []
                                          for n, rows, split in (("q", q, 0), ("k", kv, 0), ("v", kv, 0),
                                                                 ("o", d, None)))
        return [("attention_norm.weight", (d, 1), None),
                ("attention.wq.weight", (q, d), 0), *q_bias, ("attention.wk.weight", (kv, d), 0), *k_bias,
                ("attention.wv.weight", (kv, d), 0), *v_bias, ("attention.wo.weight", (d, q), 1), *o_bias,
                *norms, *sinks]

    def param_counts(self, args: ModelArgs) -> dict[str, int]:
        d = args.dim
        attention = sum(r * c for _, (r, c), _ in self.attention_params(args)) - d  # (the norm apart)
        ffn = 3 * d * args.ffn_hidden  # w1, w2, w3
        layer = attention + ffn + 2 * d  # + attention_norm, ffn_norm
        return {"embedding": args.vocab_size * d, "layer": layer, "layer_attention": attention,
                "layer_ffn": ffn, "layers": layer * args.n_layers, "norm": d,
                "output": 0 if args.tie_embeddings else args.vocab_size * d}

    def block_vectors(self, args: ModelArgs) -> int:
        """A block's parameters that multiply no activation: its norms' weights, its heads' sinks,
        its projections' biases."""
        biases = (args.q_dim + 2 * args.n_kv_heads * args.head_dim + args.dim) * args.attn_bias
        return 2 * args.dim + 2 * args.head_dim * args.qk_norm + args.n_heads * args.attn_sink + biases

    def matmul_params(self, args: ModelArgs) -> tuple[int, int]:
        return self.param_counts(args)["layer"] - self.block_vectors(args), args.vocab_size * args.dim


ADAPTER = LlamaAdapter()
