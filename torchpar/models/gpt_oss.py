"""gpt-oss: the ``moe`` family's model with gpt-oss's experts and attention — its flavours and its
Hugging Face form, ``GptOssForCausalLM``.

The model is the MoE family's (``models/moe.py``) with these of its options on: a learned bias on the
router's logits and on every expert's projections, the experts' clamped SwiGLU (``swiglu_limit``),
no dense block; softmax scores renormalized over each token's top k (gpt-oss's softmax over the top
k logits, the same numbers); attention with a learned sink per head and biases, a sliding window in
every other layer, YaRN without the ramp's rounding. This file adds the shapes and how HF names and
lays out the tensors: HF keeps each block's experts as stacks, the gate and up projections
interleaved in one (``gate_up_proj``: gate, up, gate, up, ... along the hidden width), which torchpar
keeps as two stacks (:class:`~torchpar.models.common.Interleaved`) so that tensor parallelism splits
each along the hidden width.
"""

from __future__ import annotations

from dataclasses import replace

from torchpar.models.common import Interleaved
from torchpar.models.moe import DEBUG as MOE_DEBUG
from torchpar.models.moe import MoEAdapter, MoEArgs

# gpt-oss's parts on the moe debug shape: every block routed (8 experts of 64, top 2), heads of 16,
# a window of 16 keys in every other layer, YaRN stretching 512 tokens 4 times.
DEBUG = replace(MOE_DEBUG, qk_norm=False, dense_layers=0, attn_sink=True, attn_bias=True, sliding_window=16,
                yarn_factor=4.0, yarn_original_seq_len=512, yarn_truncate=False, expert_biases=True,
                swiglu_limit=7.0)
# The released shapes: hidden 2880, 64 query heads of 64 and 8 KV heads, experts 2880 wide, top 4,
# a window of 128, YaRN 32 x 4096 tokens, RoPE base 150000.
_GPT_OSS = dict(dim=2880, n_heads=64, n_kv_heads=8, head_size=64, vocab_size=201088, rope_theta=150000.0,
                norm_eps=1e-5, max_seq_len=131072, moe_hidden=2880, top_k=4, dense_layers=0, qk_norm=False,
                attn_sink=True, attn_bias=True, sliding_window=128, full_attention_every=2, yarn_factor=32.0,
                yarn_original_seq_len=4096, yarn_truncate=False, expert_biases=True, swiglu_limit=7.0)
FLAVORS: dict[str, MoEArgs] = {
    "debug": DEBUG,
    "20B": MoEArgs(n_layers=24, experts=32, **_GPT_OSS),  # 20.9B parameters by our count
    "120B": MoEArgs(n_layers=36, experts=128, **_GPT_OSS),  # 116.8B
}


class GptOssAdapter(MoEAdapter):
    name = "gpt_oss"
    flavors = FLAVORS
    hf_architecture = "GptOssForCausalLM"
    hf_qk_norm = False

    def hf_problem(self, args: MoEArgs) -> str | None:
        return self.hf_unlike(args, (
            ("expert_biases", args.expert_biases), ("swiglu_limit", args.swiglu_limit == 7.0),
            ("attn_sink", args.attn_sink), ("attn_bias", args.attn_bias), ("score", args.score == "softmax"),
            ("normalize_top_k", args.normalize_top_k), ("route_scale", args.route_scale == 1.0),
            ("dense_layers", not args.dense_layers), ("shared_hidden", not args.shared_hidden),
            ("route_groups", args.route_groups == 1), ("qk_norm", not args.qk_norm),
            ("kv_lora_rank", not args.latent), ("tie_embeddings", not args.tie_embeddings),
            ("mtp_depth", not args.mtp_depth), ("bias_rate", not args.bias_rate),
            ("full_attention_every", not args.sliding_window or args.full_attention_every == 2)),
            "has biased routers and experts with SwiGLU clamped at 7, softmax routing over the top k, "
            "attention sinks and biases, sliding windows in every other layer or none, and no dense "
            "block, shared expert, expert groups, q/k norms, latent attention, prediction depths, tied "
            "head or balancing bias (its routers would choose other experts)")

    def hf_config(self, args: MoEArgs) -> dict:
        dense = super(MoEAdapter, self).hf_config(args)  # (Llama's fields: the RoPE spelled both ways)
        keep = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "attention_bias")
        layers = ["sliding_attention" if args.window(i) else "full_attention" for i in range(args.n_layers)]
        return {"architectures": [self.hf_architecture], "model_type": "gpt_oss",
                **{k: dense[k] for k in keep}, "intermediate_size": args.moe_hidden,
                "num_local_experts": args.experts, "num_experts_per_tok": args.top_k,
                "sliding_window": args.sliding_window or None, "layer_types": layers,
                "swiglu_limit": args.swiglu_limit}

    def hf_tensors(self, args: MoEArgs) -> list[tuple[str, str, object]]:
        out = []
        for name, hf, how in super(MoEAdapter, self).hf_tensors(args):  # (Llama's, biases included)
            if ".feed_forward." in name:
                continue  # the experts: below
            out.append((name, hf, how))
            if name.endswith("ffn_norm.weight"):
                i = name.split(".")[1]
                a, m, f = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"layers.{i}.feed_forward"
                out += [(f"layers.{i}.attention.sinks", f"{a}.sinks", None),
                        (f"{f}.router.gate.weight", f"{m}.router.weight", None),
                        (f"{f}.router.gate.bias", f"{m}.router.bias", None),
                        (f"{f}.experts.w1", f"{m}.experts.gate_up_proj", Interleaved(0)),
                        (f"{f}.experts.w3", f"{m}.experts.gate_up_proj", Interleaved(1)),
                        (f"{f}.experts.w1_bias", f"{m}.experts.gate_up_proj_bias", Interleaved(0)),
                        (f"{f}.experts.w3_bias", f"{m}.experts.gate_up_proj_bias", Interleaved(1)),
                        (f"{f}.experts.w2", f"{m}.experts.down_proj", None),
                        (f"{f}.experts.w2_bias", f"{m}.experts.down_proj_bias", None)]
        return out


ADAPTER = GptOssAdapter()
