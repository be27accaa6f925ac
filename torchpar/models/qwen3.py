"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm over queries and keys before RoPE, heads
of 128 wider than dim / heads in the larger models, RoPE base 10^6 — its flavours and its Hugging
Face form, ``Qwen3ForCausalLM``. The model is ``models/llama.py``'s (``qk_norm``, ``head_size``);
this file adds the shapes and the HF name."""

from __future__ import annotations

from dataclasses import replace

from torchpar.models.llama import DEBUG as LLAMA_DEBUG
from torchpar.models.llama import LlamaAdapter, ModelArgs

# The SwiGLU widths are Qwen3's own: ``multiple_of`` set to the width rounds 8/3 x dim up to it.
FLAVORS: dict[str, ModelArgs] = {
    "debug": replace(LLAMA_DEBUG, qk_norm=True),
    # Qwen3-0.6B: 28 blocks of 16 heads of 128 (8 KV heads) over dim 1024, SwiGLU 3072, tied.
    "0.6B": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_size=128, qk_norm=True,
                      vocab_size=151936, multiple_of=3072, rope_theta=1e6, norm_eps=1e-6, max_seq_len=40960,
                      tie_embeddings=True),
    # Qwen3-8B: 36 blocks of 32 heads of 128 (8 KV heads), SwiGLU 12288, untied.
    "8B": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_size=128, qk_norm=True,
                    vocab_size=151936, multiple_of=12288, rope_theta=1e6, norm_eps=1e-6, max_seq_len=40960),
}


class Qwen3Adapter(LlamaAdapter):
    name = "qwen3"
    flavors = FLAVORS
    hf_architecture = "Qwen3ForCausalLM"
    hf_qk_norm = True

    def hf_problem(self, args: ModelArgs) -> str | None:
        if not args.qk_norm:
            return f"model.qk_norm = false: {self.hf_architecture} always has per-head query/key norms"
        return super().hf_problem(args)

    def hf_config(self, args: ModelArgs) -> dict:
        return {**super().hf_config(args), "model_type": "qwen3", "use_sliding_window": False}


ADAPTER = Qwen3Adapter()
