"""DeepSeek-V3: the ``moe`` family's model with multi-head latent attention, sigmoid routing over
groups of experts with the auxiliary-loss-free bias, shared experts and the first blocks dense —
its flavours and its Hugging Face form, ``DeepseekV3ForCausalLM``.

The model is the MoE family's (``models/moe.py``: the blocks, the router, :class:`Routing`) with the
attention of ``models/llama.py`` (:class:`~torchpar.models.llama.LatentAttention`); this file adds
only what makes it DeepSeek-V3: the shapes, and how HF names and lays out the tensors. HF fuses the
key/value latent's projection and the rotary key's into one tensor (``kv_a_proj_with_mqa``: the
latent's rows, then the rotary key's), which torchpar keeps apart so that tensor parallelism can
hand each rank the rotary key as its own (:class:`~torchpar.models.common.RowsOf`); HF's rotary
dims are interleaved pairs (``rope_interleave``), as torchpar's are, so no row is permuted. The
routing bias (``e_score_correction_bias`` per MoE block) is the trainer's :class:`Routing` state,
read and written as ``routing.expert_bias``. Multi-token prediction's depths are HF's layers after
``num_hidden_layers`` (``num_nextn_predict_layers`` of them, as DeepSeek-V3's checkpoints hold its
one): a block with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``, and copies of the
embedding and the head (:class:`~torchpar.models.common.Copy`: written, never read); transformers
leaves them out of its model.
"""

from __future__ import annotations

from dataclasses import replace

from torchpar.models.common import Copy, RowsOf, StackRow
from torchpar.models.moe import BIAS_STATE, MoEAdapter, MoEArgs
from torchpar.models.moe import DEBUG as MOE_DEBUG

# The moe debug shape with DeepSeek-V3's parts: latent attention (queries from a latent of 64, keys
# and values from one of 32, heads of 16 + a rotary 8), sigmoid scores renormalized and scaled by
# 2.5, one shared expert of 64, 4 groups of 2 experts of which each token's come from the best 2.
DEBUG = replace(MOE_DEBUG, qk_norm=False, n_kv_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_rope_dim=8,
                score="sigmoid", route_scale=2.5, shared_hidden=64, route_groups=4, route_top_groups=2)
FLAVORS: dict[str, MoEArgs] = {
    "debug": DEBUG,
    # DeepSeek-V3 (671B, 37B active): queries from a latent of 1536, keys and values from one of 512,
    # heads of 128 + 64 rotary; 256 experts of 2048, top 8 from 4 of 8 groups, one shared expert; the
    # first 3 blocks dense, 18432 wide; pretrained at 4096 tokens (its YaRN came after).
    "671B": MoEArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_size=128, q_lora_rank=1536,
                    kv_lora_rank=512, qk_rope_dim=64, vocab_size=129280, ffn_dim_multiplier=0.9643,
                    multiple_of=1024, rope_theta=10000.0, norm_eps=1e-6, max_seq_len=4096, experts=256,
                    top_k=8, moe_hidden=2048, shared_hidden=2048, dense_layers=3, score="sigmoid",
                    route_scale=2.5, route_groups=8, route_top_groups=4),
    # DeepSeek-V2-Lite (16B, 2.4B active): queries projected from x; 64 experts of 1408, top 6 by
    # softmax scores (not renormalized), two shared experts; the first block dense. (Its HF form is
    # DeepSeek-V2's, which this family does not write.)
    "v2-lite-16B": MoEArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, head_size=128, kv_lora_rank=512,
                           qk_rope_dim=64, vocab_size=102400, ffn_dim_multiplier=1.0, multiple_of=10944,
                           rope_theta=10000.0, norm_eps=1e-6, max_seq_len=4096, experts=64, top_k=6,
                           moe_hidden=1408, shared_hidden=2816, dense_layers=1, normalize_top_k=False),
}


class DeepSeekV3Adapter(MoEAdapter):
    name = "deepseek_v3"
    flavors = FLAVORS
    hf_architecture = "DeepseekV3ForCausalLM"

    def hf_problem(self, args: MoEArgs) -> str | None:
        return self.hf_unlike(args, (
            ("kv_lora_rank", args.latent), ("score", args.score == "sigmoid"),
            ("shared_hidden", args.shared_hidden and args.shared_hidden % args.moe_hidden == 0),
            ("attn_sink", not args.attn_sink), ("sliding_window", not args.sliding_window),
            ("expert_biases", not args.expert_biases), ("swiglu_limit", not args.swiglu_limit)),
            "has latent attention, routes by sigmoid scores, has shared experts as wide as a multiple of "
            "a routed one, plain SwiGLU experts without biases, and no attention sinks or sliding windows")

    def hf_config(self, args: MoEArgs) -> dict:
        dense = super(MoEAdapter, self).hf_config(args)  # (Llama's fields: the RoPE spelled both ways)
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rope_theta", "rope_parameters", "rope_scaling",
                "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "hidden_act",
                "attention_bias")
        return {"architectures": [self.hf_architecture], "model_type": "deepseek_v3",
                **{k: dense[k] for k in keep}, "head_dim": args.rope_dim,
                "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
                "qk_nope_head_dim": args.head_dim, "qk_rope_head_dim": args.rope_dim,
                "v_head_dim": args.v_head_dim, "rope_interleave": True,
                "n_routed_experts": args.experts, "n_shared_experts": args.shared_hidden // args.moe_hidden,
                "moe_intermediate_size": args.moe_hidden, "num_experts_per_tok": args.top_k,
                "first_k_dense_replace": args.dense_layers, "n_group": args.route_groups,
                "topk_group": args.route_top_groups, "norm_topk_prob": args.normalize_top_k,
                "routed_scaling_factor": args.route_scale, "num_nextn_predict_layers": args.mtp_depth}

    @staticmethod
    def _hf_rope(args: MoEArgs) -> dict:
        rope = MoEAdapter._hf_rope(args)
        # DeepSeek's YaRN: the temperature on the whole score, none on cos and sin (mscale = mscale_all_dim)
        return {**rope, "mscale": 1.0, "mscale_all_dim": 1.0} if rope["rope_type"] == "yarn" else rope

    def hf_tensors(self, args: MoEArgs) -> list[tuple[str, str, object]]:
        out = [("tok_embeddings.weight", "model.embed_tokens.weight", None)]
        for i in range(args.n_layers + args.mtp_depth):
            a, m, t = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"layers.{i}"
            queries = ([(f"{t}.attention.wq_a.weight", f"{a}.q_a_proj.weight", None),
                        (f"{t}.attention.q_a_norm.weight", f"{a}.q_a_layernorm.weight", None),
                        (f"{t}.attention.wq_b.weight", f"{a}.q_b_proj.weight", None)] if args.q_lora_rank
                       else [(f"{t}.attention.wq.weight", f"{a}.q_proj.weight", None)])
            kv_a = f"{a}.kv_a_proj_with_mqa.weight"  # the latent's rows, then the rotary key's
            out += [(f"{t}.attention_norm.weight", f"model.layers.{i}.input_layernorm.weight", None),
                    *queries, (f"{t}.attention.wkv_a.weight", kv_a, RowsOf(0)),
                    (f"{t}.attention.wk_rope.weight", kv_a, RowsOf(args.kv_lora_rank)),
                    (f"{t}.attention.kv_a_norm.weight", f"{a}.kv_a_layernorm.weight", None),
                    (f"{t}.attention.wkv_b.weight", f"{a}.kv_b_proj.weight", None),
                    (f"{t}.attention.wo.weight", f"{a}.o_proj.weight", None),
                    (f"{t}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight", None)]
            f = f"{t}.feed_forward"
            if i < args.dense_layers:
                out += [(f"{f}.{w}.weight", f"{m}.{proj}.weight", None)
                        for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
                continue
            row = i - args.dense_layers  # the block's row of the routing bias
            out += [(f"{f}.router.gate.weight", f"{m}.gate.weight", None),
                    (BIAS_STATE, f"{m}.gate.e_score_correction_bias",
                     StackRow(row, transposed=False))]
            out += [(f"{f}.experts.{w}", f"{m}.experts.{j}.{proj}.weight", StackRow(j))
                    for j in range(args.experts)
                    for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
            out += [(f"{f}.shared.{w}.weight", f"{m}.shared_experts.{proj}.weight", None)
                    for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
            if i >= args.n_layers:  # a prediction depth: a block after the model's own, with its join
                h = f"model.layers.{i}"
                out += [(f"{t}.join.enorm.weight", f"{h}.enorm.weight", None),
                        (f"{t}.join.hnorm.weight", f"{h}.hnorm.weight", None),
                        (f"{t}.join.eh_proj.weight", f"{h}.eh_proj.weight", None),
                        (f"{t}.final_norm.weight", f"{h}.shared_head.norm.weight", None),
                        ("tok_embeddings.weight", f"{h}.embed_tokens.weight", Copy()),
                        ("output.weight", f"{h}.shared_head.head.weight", Copy())]
        out.append(("norm.weight", "model.norm.weight", None))
        if not args.tie_embeddings:
            out.append(("output.weight", "lm_head.weight", None))
        return out


ADAPTER = DeepSeekV3Adapter()
