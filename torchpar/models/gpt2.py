"""A GPT-2-style decoder you can read top to bottom.

Learned absolute position embeddings, LayerNorm with bias, full multi-head attention through
``F.scaled_dot_product_attention``, a GELU feed-forward four times the width, and biases on every
linear but the head. Deliberately named differently from the Llama family (``wte``, ``attn.query``,
``mlp.fc``) so that the parallel code has to find modules through the adapter, not by name.
Single-device code: nothing here knows about process groups. A pipeline stage may remove the
embeddings, layers, final norm or head; the forward skips what is missing.

Shapes: b = batch, s = sequence, d = dim, h = local heads, hd = head_dim, v = vocab.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from torchpar.models.common import Documents, Mask, ModelAdapter, SeededInit, attention, document_layout


@dataclass(frozen=True)
class GPT2Args:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50304
    max_seq_len: int = 1024  # rows of the position table: the longest sequence the model takes
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        """Full multi-head attention: one key/value head per query head. Exposed so that generic
        code reading ``n_kv_heads`` works for this family too."""
        return self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.dim

    def to_dict(self) -> dict:
        return asdict(self)


# The same names and sizes as Llama's debug flavours, so a test switches family by name alone:
# 8 layers (4 pipeline stages x 2), 8 heads (tp=4 divides them), vocab 4096 = the shipped tokenizer's.
DEBUG = GPT2Args(dim=128, n_layers=8, n_heads=8, vocab_size=4096, max_seq_len=1024, tie_embeddings=False)
FLAVORS: dict[str, GPT2Args] = {
    "debug": DEBUG,
    "debug-tied": replace(DEBUG, tie_embeddings=True),
    # GPT-2 small, its vocabulary of 50257 padded to a multiple of 128.
    "124M": GPT2Args(dim=768, n_layers=12, n_heads=12, vocab_size=50304, max_seq_len=1024,
                     tie_embeddings=True),
}


# ---------------------------------------------------------------- modules

class CausalSelfAttention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.head_dim
        # Separate projections rather than one fused qkv: split column-wise, each rank then holds
        # whole heads of q, k and v alike.
        self.query = nn.Linear(args.dim, args.dim)
        self.key = nn.Linear(args.dim, args.dim)
        self.value = nn.Linear(args.dim, args.dim)
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: under tensor parallelism each rank holds only its share of the heads.
        q = self.query(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, h, s, hd]
        k = self.key(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, h, s, hd]
        v = self.value(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, h, s, hd]
        # mask: None = causal over the window, else kept inside documents (common.attention).
        out = attention(q, k, v, mask)  # [b, h, s, hd]
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))  # [b, s, d]


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.fc = nn.Linear(args.dim, args.ffn_hidden)
        self.proj = nn.Linear(args.ffn_hidden, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # [b, s, 4d] -> [b, s, d]


class Block(nn.Module):
    """Pre-norm residual block: each sub-layer reads a normalized copy and adds to the stream."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = CausalSelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        h = x + self.attn(self.ln_1(x), mask)
        return h + self.mlp(self.ln_2(h))


class GPT2(SeededInit):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)
        # Keyed by the global layer index, so a pipeline stage keeps its layers' names.
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    def block_args(self, positions: torch.Tensor | None = None) -> tuple[()]:
        """What every block takes after the hidden states: nothing (positions are added once, at
        the bottom)."""
        return ()

    def tie_weights(self) -> None:
        """Share the token table with the head (when tied and both are here). Moving a meta model
        to a device or sharding it can replace the parameter objects, so callers re-tie."""
        if self.args.tie_embeddings and self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor, documents: Documents = None) -> torch.Tensor:
        """x: token ids [b, s] on the first stage, hidden states [b, s, d] after it. documents:
        each token's document [b, s] to keep attention inside (positions restart per document)."""
        # (the compute dtype: the table's on the first stage, the incoming hidden states' after it)
        dtype = self.wte.weight.dtype if self.wte is not None else x.dtype
        positions, mask = (document_layout(documents, dtype, x.device) if documents is not None
                           else (None, None))
        if self.wte is not None:
            # [1, s], not [s]: the position lookup then comes out [1, s, d], sequence on dim 1 like
            # the token lookup's [b, s, d], so sequence parallelism shards both the same way.
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            h = self.wte(x) + self.wpe(positions)  # [b, s, d] + [1 or b, s, d]
        else:
            h = x  # [b, s, d]
        for layer in self.layers.values():
            h = layer(h, *self.block_args(), mask)
        if self.ln_f is not None:
            h = self.ln_f(h)
        return self.lm_head(h) if self.lm_head is not None else h  # [b, s, v] logits

    # ------------------------------------------------------------ initialization

    def init_std(self, name: str) -> float | str:
        if name.endswith(".bias"):
            return "zeros"
        if name.split(".")[-2] in ("ln_1", "ln_2", "ln_f"):
            return "ones"  # LayerNorm weights
        if name == "wpe.weight":
            return 0.01
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            # Residual projections: scaled with depth, so the stream's variance stays bounded.
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02  # wte, an untied lm_head, query/key/value, fc


# ---------------------------------------------------------------- the adapter


class GPT2Adapter(ModelAdapter):
    name = "gpt2"
    model_class = GPT2
    args_class = GPT2Args
    flavors = FLAVORS
    first_stage = ("wte", "wpe")
    last_stage = ("ln_f", "lm_head")
    # Megatron's split: query/key/value and fc column-wise (each rank its share of heads and hidden
    # units), the two proj row-wise. Both tables are row-sharded: each rank looks up the rows it
    # holds and the partial results sum to the full lookup, for positions as for tokens.
    top_plan = {"wte": "embedding", "wpe": "embedding", "ln_f": "norm", "lm_head": "head"}
    block_plan = {
        "ln_1": "norm", "attn": "input",
        "attn.query": "colwise", "attn.key": "colwise", "attn.value": "colwise", "attn.proj": "rowwise",
        "ln_2": "norm", "mlp": "input",
        "mlp.fc": "colwise", "mlp.proj": "rowwise",
    }

    def tp_divisors(self, args: GPT2Args) -> dict[str, int]:
        return {"n_heads": args.n_heads, "ffn hidden size": args.ffn_hidden,
                "vocab_size": args.vocab_size, "max_seq_len": args.max_seq_len}

    def stage_params(self, args: GPT2Args, first: bool, last: bool, layers: range):
        d, hid = args.dim, args.ffn_hidden
        out = []
        if first:
            out += [("wte.weight", (args.vocab_size, d), 0), ("wpe.weight", (args.max_seq_len, d), 0)]

        def colwise(name, rows, cols):  # output features sharded: the weight's rows and the bias
            return [(f"{name}.weight", (rows, cols), 0), (f"{name}.bias", (rows, 1), 0)]

        def rowwise(name, rows, cols):  # input features sharded; the bias is added once, replicated
            return [(f"{name}.weight", (rows, cols), 1), (f"{name}.bias", (rows, 1), None)]

        def norm(name):
            return [(f"{name}.weight", (d, 1), None), (f"{name}.bias", (d, 1), None)]

        block = (norm("ln_1")
                 + colwise("attn.query", d, d) + colwise("attn.key", d, d) + colwise("attn.value", d, d)
                 + rowwise("attn.proj", d, d)
                 + norm("ln_2")
                 + colwise("mlp.fc", hid, d) + rowwise("mlp.proj", d, hid))
        out += block * len(layers)
        if last:
            out += norm("ln_f")
            if not (args.tie_embeddings and first):
                out.append(("lm_head.weight", (args.vocab_size, d), 0))
        return out

    def param_counts(self, args: GPT2Args) -> dict[str, int]:
        d, hid = args.dim, args.ffn_hidden
        attention = 4 * (d * d + d)  # query, key, value, proj with biases
        ffn = (d * hid + hid) + (hid * d + d)  # fc, proj with biases
        layer = attention + ffn + 2 * 2 * d  # + ln_1, ln_2 (weight and bias each)
        return {"embedding": (args.vocab_size + args.max_seq_len) * d, "layer": layer,
                "layer_attention": attention, "layer_ffn": ffn, "layers": layer * args.n_layers,
                "norm": 2 * d, "output": 0 if args.tie_embeddings else args.vocab_size * d}

    def matmul_params(self, args: GPT2Args) -> tuple[int, int]:
        d = args.dim
        return 4 * d * d + 2 * d * args.ffn_hidden, args.vocab_size * d


ADAPTER = GPT2Adapter()
