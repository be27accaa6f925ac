"""The job configuration's sections: one dataclass per TOML section, a docstring per field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, choices: tuple | None = None):
    """A config field with its docstring (shown by ``--help``) and optional allowed values."""
    if isinstance(default, (list, dict)):
        kw = {"default_factory": lambda: type(default)(default)}
    else:
        kw = {"default": default}
    return field(metadata={"help": help, "choices": choices}, **kw)


DTYPES = ("float32", "bfloat16")


@dataclass
class Job:
    dump_folder: str = opt(
        "./outputs", "Folder for metrics.jsonl, wandb files and checkpoints; a folder of its own (not /, "
        "the home folder, the working folder or one above it, or a Git repository's root: refused).")
    description: str = opt("torchpar job", "Free text describing the run; logged with the config.")
    rank_logs: bool = opt(True, "Under torchrun, every rank also writes its output to "
                                "<dump_folder>/logs/rank_<N>.log (the console shows LOG_RANK's ranks).")


@dataclass
class Model:
    name: str = opt(
        "llama3",
        "Model family, one of those registered in torchpar/models/__init__.py (MODELS): 'llama3' (RMSNorm, "
        "RoPE, GQA, SwiGLU), 'qwen3' (Llama with per-head q/k norms), 'gpt2' (learned positions, LayerNorm, "
        "GELU MLP, biases), 'moe' (Llama blocks "
        "whose feed-forwards are mixtures of experts, shaped like Qwen3-MoE) and 'deepseek_v3' (the same "
        "with latent attention, group-limited sigmoid routing and shared experts: DeepSeek-V3) and "
        "'gpt_oss' (the same with biased experts and routers, clamped SwiGLU, attention sinks and sliding "
        "windows) ship with torchpar.",
    )
    flavor: str = opt("debug", "Size preset of the family (FLAVORS in torchpar/models/<family>.py).")
    tokenizer_path: str = opt(
        "builtin",
        "tiktoken BPE rank file (Llama-3 tokenizer.model format), a Hugging Face tokenizers file "
        "(tokenizer.json: Qwen's), or a model folder holding one; 'builtin' = the 4k vocabulary shipped in "
        "torchpar/assets, trained by scripts/train_tokenizer.py.",
    )
    # Shape overrides: 0 keeps the flavour's value.
    n_layers: int = opt(0, "Override the flavour's layer count (0 = the flavour's).")
    dim: int = opt(0, "Override the flavour's hidden size (0 = the flavour's).")
    n_heads: int = opt(0, "Override the flavour's attention heads (0 = the flavour's).")
    n_kv_heads: int = opt(0, "Llama: override the grouped-query key/value heads (0 = the flavour's).")
    vocab_size: int = opt(0, "Override the vocabulary size, at least the tokenizer's (0 = the flavour's).")
    max_seq_len: int = opt(0, "Override the longest sequence, the RoPE/position table (0 = the flavour's).")
    ffn_dim_multiplier: float = opt(0.0, "Llama: override the SwiGLU width multiplier (0 = the flavour's).")
    multiple_of: int = opt(0, "Llama: override what the SwiGLU width rounds up to (0 = the flavour's).")
    rope_theta: float = opt(0.0, "Llama: override the RoPE base (0 = the flavour's).")
    qk_norm: bool | None = opt(None, "Llama and MoE: RMSNorm over each query and key head before RoPE "
                                     "(Qwen3's); unset = the flavour's.")
    attn_sink: bool | None = opt(
        None, "Llama and MoE: a learned logit per attention head in each softmax's denominator (an attention "
              "sink, as gpt-oss has), so a head may attend to nothing. The scores are written out (no fused "
              "kernel takes a sink): s x s per head, for research at short sequences. Unset = the flavour's "
              "(none).")
    attn_bias: bool | None = opt(
        None, "Llama and MoE: biases on the query, key, value and output projections (gpt-oss's; Hugging "
              "Face Llama's attention_bias). Unset = the flavour's (none).")
    sliding_window: int = opt(
        0, "Llama and MoE: a sliding window of this many keys (each query and the ones before it) in every "
           "layer but each full_attention_every-th, as gpt-oss alternates them; inside documents under "
           "document masking. Context parallelism by 'alltoall' (the ring refuses it). 0 = the flavour's "
           "(none).")
    full_attention_every: int = opt(
        0, "Llama and MoE: with sliding_window, layers N-1, 2N-1, ... attend to every earlier key (gpt-oss: "
           "2, Gemma 3: 6; 1 = no layer slides). 0 = the flavour's (2).")
    yarn_factor: float = opt(
        0.0, "Llama and MoE: YaRN's RoPE scaling, stretching the context RoPE was trained at "
             "(yarn_original_seq_len) this many times (gpt-oss: 32 over 4096); frequencies that turn slowly "
             "over it are interpolated, fast ones kept, and cos/sin scaled by 0.1 ln(factor) + 1. 0 = the "
             "flavour's (plain RoPE).")
    yarn_original_seq_len: int = opt(
        0, "Llama and MoE: the context RoPE was trained at, which yarn_factor stretches (needed with it). "
           "0 = the flavour's.")
    yarn_truncate: bool | None = opt(
        None, "Llama and MoE: YaRN's ramp between kept and interpolated frequencies starts and ends at whole "
              "pairs (transformers' default); false keeps the ends where they fall (gpt-oss's). Unset = the "
              "flavour's (true; gpt_oss: false).")
    kv_lora_rank: int = opt(
        0, "Llama and MoE: multi-head latent attention (DeepSeek-V2/V3's) with keys and values projected up "
           "from a normalized latent this wide per token (DeepSeek-V3: 512); each q/k head is its head size "
           "wide without RoPE plus qk_rope_dim with it, the rotary key one per token shared by the heads. "
           "Needs n_kv_heads = n_heads. Under tensor parallelism the heads are split, the latents computed "
           "whole on every rank. 0 = the flavour's (Llama debug-mla and the deepseek_v3 family: latent; the "
           "others grouped-query).")
    q_lora_rank: int = opt(
        0, "Llama and MoE: with kv_lora_rank, queries projected up from a normalized latent this wide "
           "(DeepSeek-V3: 1536) instead of from the hidden state. 0 = the flavour's.")
    qk_rope_dim: int = opt(
        0, "Llama and MoE: with kv_lora_rank, the rotary part of each query and key head (DeepSeek-V3: 64). "
           "0 = the flavour's (or half the head size).")
    v_head_size: int = opt(
        0, "Llama and MoE: with kv_lora_rank, each value head's width, at most a query head's (DeepSeek-V3: "
           "128). 0 = the flavour's (or the head size).")
    mtp_depth: int = opt(
        0, "Llama and MoE: multi-token prediction (DeepSeek-V3's): this many depths after the last block, "
           "each a block over the previous depth's state and the next token's embedding, predicting one "
           "token further ahead through the shared head; trained only (logged as loss/mtp1, ...: each "
           "depth's cross-entropy per token). Under pipeline parallelism the depths live on the last stage "
           "and their tokens' embeddings travel with the activations. 0 = none (DeepSeek-V3: 1).")
    mtp_weight: float = opt(
        0.0, "Llama and MoE: with mtp_depth, the depths' cross-entropies join the loss with this weight "
             "over the depths (DeepSeek-V3: 0.3, later 0.1). 0 = the flavour's (0.3).")
    experts: int = opt(0, "MoE: override the routed experts per block (0 = the flavour's).")
    top_k: int = opt(0, "MoE: override the experts each token is routed to (0 = the flavour's).")
    capacity_factor: float = opt(
        0.0, "MoE: 0 = dropless (every routed token is computed); c > 0 = each expert takes at most "
             "ceil(c x seq_len x top_k / experts) tokens of each sequence, the latest beyond that dropped "
             "(their expert output is zero; counted in moe/dropped).")
    balance_coeff: float = opt(
        0.0, "MoE: coefficient of the auxiliary balance loss (experts x sum over experts of the share of "
             "slots it got x its mean router score; 1 when balanced), logged as loss/balance. 0 = none.")
    route_groups: int = opt(
        0, "MoE: group-limited routing (DeepSeek-V3's node-limited routing): the experts in this many groups "
           "of consecutive experts; each token keeps the route_top_groups groups whose two best scores (with "
           "the balancing bias) sum highest and takes its top_k experts among theirs. With "
           "expert_parallel_degree equal to it, a group is one rank's experts, so each token's slots reach "
           "at most route_top_groups ranks. 0 = the flavour's (deepseek_v3 debug: 4; 1 = none).")
    route_top_groups: int = opt(
        0, "MoE: the groups each token's experts come from, with route_groups (DeepSeek-V3: 4 of 8). 0 = the "
           "flavour's.")
    expert_biases: bool | None = opt(
        None, "MoE: learned biases on the router's logits and on every expert's projections (gpt-oss's). "
              "Unset = the flavour's (none).")
    swiglu_limit: float = opt(
        0.0, "MoE: gpt-oss's clamped SwiGLU in the experts: the gate clamped to at most this, the up "
             "projection to within +-this, and gate x sigmoid(1.702 gate) x (up + 1) (gpt-oss: 7). 0 = the "
             "flavour's (plain SwiGLU).")
    bias_rate: float = opt(
        0.0, "MoE: the auxiliary-loss-free balancing: after every step each expert's routing bias moves by "
             "this much toward the mean load (down when it got more slots than the mean, summed over all "
             "ranks); it steers which experts are chosen, not their weights. 0 = off (DeepSeek-V3: 0.001).")


@dataclass
class Data:
    dataset: str = opt(
        "stdlib",
        "'stdlib' = the Python standard library's own sources (no download); 'files' = local .txt/.jsonl "
        "files or globs in `path`; 'hf' = a Hugging Face `datasets` dataset; 'tokenized' = a folder written "
        "by `torchpar prepare-data` (also recognised under 'files' when `path` is such a folder): each rank "
        "reads only its own windows.",
        ("stdlib", "files", "hf", "tokenized"),
    )
    path: str = opt("", "For 'files': comma-separated paths or globs. For 'hf': dataset name or local path. "
                        "For 'tokenized': the prepared folder.")
    text_field: str = opt("text", "Key of the text in .jsonl records and HF rows.")
    format: str = opt(
        "text", "'text' = documents of text, every token a loss target; 'chat' = conversations for "
        "supervised fine-tuning: each .jsonl record's `messages_field`, a list of {\"role\", \"content\"}, "
        "rendered by `chat_template`, the loss on the assistant's turns only, packed whole into windows "
        "(padded, never split; set document_masking = true so none attends to another). 'files' or a "
        "prepared corpus.",
        ("text", "chat"))
    messages_field: str = opt("messages", "'chat': key of the conversation in .jsonl records.")
    chat_template: str = opt(
        "llama3", "'chat': how a conversation becomes tokens: 'llama3' (Llama 3's headers and <|eot_id|>; "
        "its turn markers follow BOS and EOS, so with the builtin vocabulary a model needs vocab_size >= "
        "4104), 'qwen3' (Qwen's <|im_start|> / <|im_end|>: a Qwen tokenizer.json).", ("llama3", "qwen3"))
    chat_too_long: str = opt(
        "truncate", "'chat': a conversation longer than a window (training.seq_len + 1 tokens): 'truncate' "
        "keeps its first window of tokens, 'drop' leaves it out; counted either way.", ("truncate", "drop"))
    split: str = opt(
        "train", "'train' or the held-out 'validation' split of the stdlib corpus; HF split name for 'hf'."
    )
    lanes: int = opt(
        64,
        "Documents are read through this many interleaved streams so a batch mixes files; 1 = one file "
        "after another.",
    )
    num_workers: int = opt(0, "StatefulDataLoader worker processes (0 = load in the training process). "
                              "Workers split the lanes (lane mod workers): each tokenizes or reads only its "
                              "own. Worth it for text; a prepared corpus reads faster without them.")
    sources: list = opt(
        [],
        "A weighted mixture instead of the single source above: [[data.sources]] tables, each with `weight` "
        "(> 0) and `dataset`, `path`, `text_field`, `split` as above, and an optional `name` for the logs. "
        "Window g of the global stream comes from a source fixed by g alone, so the proportions are exact "
        "over every period of windows (70/30 -> 7 and 3 in every 10) under any layout; tokens read per "
        "source are logged and checkpointed. [validation] still reads the single source above.",
    )
    document_masking: bool = opt(
        False,
        "Attention stays inside each document of a packed window (block-causal: a token sees earlier tokens "
        "of its own document only) and positions restart at every document's BOS. false = plain causal "
        "attention over the whole window.",
    )
    resume_position: bool = opt(
        True,
        "On resume, continue the data where the checkpoint left it. false = read the corpus from its start "
        "(for a new corpus, tokenizer or data.lanes); the model, optimizer and step are still restored.",
    )


@dataclass
class Training:
    steps: int = opt(300, "Optimizer steps to run.")
    local_batch_size: int = opt(8, "Sequences per data-parallel rank per micro-step.")
    global_batch_size: int = opt(
        0,
        "Sequences per optimizer step over all data-parallel ranks; must equal local_batch_size x "
        "grad_accum_steps x dp degree. 0 = local_batch_size x dp degree (no accumulation).",
    )
    seq_len: int = opt(128, "Tokens per training sequence.")
    seed: int = opt(0, "Seed for weight init and data order; the same on every rank.")
    max_norm: float = opt(1.0, "Gradient clipping threshold on the global norm (0 = no clipping).")
    mixed_precision_param: str = opt(
        "auto", "Dtype of compute; weights, gradients and optimizer states stay float32 (the master copy). "
        "'auto' = bfloat16 on GPUs, float32 on CPUs (where bf16 is ~10x slower). bfloat16 = parameters and "
        "activations in bf16 for forward and backward, over an fp32 master copy that the optimizer updates: "
        "FSDP2's MixedPrecisionPolicy under zero_stage 3, the flat engine's bf16 buffer under stages 0-2.",
        ("auto", *DTYPES))
    mixed_precision_reduce: str = opt(
        "float32", "Dtype of gradient reduction across data-parallel ranks (and, under zero stages 0-2, of "
        "the gradient buckets). bfloat16 halves the bytes sent; the optimizer still gets fp32 gradients.",
        DTYPES)
    memory_cap_gib: float = opt(
        0.0, "Device memory a rank may use, in GiB; 0 = no cap. A layout whose predicted peak (the "
        "planner's: state, activations, transients) exceeds it on some rank is refused before launch, naming "
        "what would fit; on GPUs the caching allocator is also capped to it.")
    tf32: bool = opt(True, "GPUs: fp32 matmuls in TF32 (what stays fp32 under bf16, or an fp32 run); false "
                           "for full fp32 precision.")
    activation_checkpoint: str = opt(
        "none", "Recompute activations in backward: 'full' = a block keeps only its input (see "
        "activation_checkpoint_every); 'selective' = every block keeps its matmul, attention and "
        "TP-reduction outputs and recomputes the elementwise work between them.",
        ("none", "full", "selective"))
    activation_checkpoint_every: int = opt(
        1, "With activation_checkpoint = 'full': recompute every k-th block only (blocks k-1, 2k-1, ... by "
        "global index); the others keep all their activations.")
    compile: bool = opt(False, "torch.compile each transformer block.")
    on_divergence: str = opt(
        "stop", "A step whose loss or gradient norm is not finite, whose gradient norm is exactly 0 (a dead "
                "model), or whose loss spikes (see loss_spike_factor) is never applied: 'stop' = end the "
                "run with one line naming the step and the last good checkpoint; 'skip' = drop that "
                "batch's update and go on (counted in metrics as skipped_steps; the learning-rate "
                "schedule still advances), and stop as 'stop' does after 10 skipped in a row. The host "
                "learns of it at the next step, log, evaluation or save, and never saves after it.",
        ("stop", "skip"))
    loss_spike_factor: float = opt(
        0.0, "Treat a loss above this factor x the mean of the last loss_spike_window steps as divergence "
        "(0 = only non-finite values). The check reads the loss on the host before each update.")
    loss_spike_window: int = opt(20, "Steps whose mean loss the spike check compares with.")


@dataclass
class Optimizer:
    name: str = opt(
        "adamw", "'adamw', 'muon' (Muon for the hidden matrices, AdamW for embeddings, head, norms and "
        "biases), 'adafactor' (torch's classes), or a torch.optim.Optimizer subclass by dotted path "
        "('torch.optim.SGD'). Each is a Kind in torchpar/optim.py: add yours there.")
    lr: float = opt(3e-3, "Peak learning rate (under 'muon': of the parameters AdamW updates).")
    muon_lr: float = opt(0.02, "'muon' only: peak learning rate of the hidden matrices Muon updates "
                               "(scaled per matrix by torch.optim.Muon's adjust_lr_fn).")
    beta1: float = opt(0.9, "Adam beta1 (for classes that take betas).")
    beta2: float = opt(0.95, "Adam beta2 (for classes that take betas).")
    eps: float = opt(1e-8, "Adam epsilon (for classes whose eps is one float).")
    weight_decay: float = opt(0.1, "Decoupled weight decay, of matrices only (the hidden ones and the "
                                   "output head): norm gains, biases and embeddings keep none.")
    decay_all: bool = opt(False, "Weight decay on every parameter, as before parameter groups existed "
                                 "(to reproduce such runs).")
    embedding_lr_mult: float = opt(1.0, "Learning-rate multiplier of the embeddings.")
    head_lr_mult: float = opt(1.0, "Learning-rate multiplier of the output head.")
    kwargs: dict = opt({}, "Further keyword arguments of the optimizer class, as a TOML table "
                           "([optimizer.kwargs], or --optimizer.kwargs 'momentum=0.9,nesterov=true'); "
                           "under 'muon' they go to torch.optim.Muon (momentum, ns_steps, adjust_lr_fn).")
    implementation: str = opt(
        "auto", "'auto' = fused for AdamW and Adam, foreach otherwise (fused AdamW: one kernel per step "
        "on CUDA and CPU alike, which also drops a divergent step on the device, so the loop need not "
        "wait to read the loss unless training.loss_spike_factor > 0); with foreach, for-loop or an "
        "optimizer without a fused kernel (Muon) the host reads every step's loss before its update.",
        ("auto", "fused", "foreach", "for-loop")
    )
    state_dtype: str = opt(
        "float32", "dtype of the optimizer's moments — AdamW's two (also Muon's AdamW part) and Muon's "
        "momentum: 'bfloat16' halves them (AdamW: 4 bytes per parameter instead of 8), updated in fp32 "
        "and rounded to nearest when stored; the weights stay fp32 (the master copy is kept). Other "
        "optimizers keep float32. Checkpoints load across the two (each value cast).", DTYPES)


@dataclass
class Quantize:
    float8: str = opt(
        "off", "FP8 training of the blocks' linear layers through torchao's Float8Linear, and of a mixture "
        "of experts' routed experts (torchao's grouped FP8 GEMM on a CUDA GPU of compute capability 9.0, "
        "else one FP8 matmul per expert): 'tensorwise' "
        "(one scale per tensor, the fastest; under ZeRO-3 its weights are all-gathered in FP8), "
        "'rowwise' (a scale per row of each operand, more accurate), 'off'. Each matmul of forward and "
        "backward runs on FP8 casts of its operands; the weights, gradients and optimizer keep their "
        "dtypes. Needs torchao.", ("off", "tensorwise", "rowwise"))
    modules: list = opt(["layers.*"], "Linear layers and routed-expert modules to convert, as shell "
                                      "patterns (fnmatch) over their names ('layers.*.attention.*', "
                                      "'layers.*.feed_forward.experts'); the embedding and the output head "
                                      "never are.")
    exclude: list = opt(["*.gate"], "Patterns of layers left in the compute dtype among those modules "
                                    "match (default: a mixture of experts' routers, whose logits choose "
                                    "each token's experts; '*.experts' leaves the routed experts).")
    skip_small: bool = opt(
        True, "Leave the layers too small to gain from FP8, by torchao's rule measured on H100 (N = out "
        "features, K = in): tensorwise when K <= 4096 and N <= 1024; rowwise when N <= 2048, K <= 1024, "
        "or N <= 4096 and K <= 2048; a routed-expert module when any of its matrices (per expert) is. "
        "false = every matched layer.")
    float8_all_gather: bool = opt(
        True, "With 'tensorwise' under ZeRO-3: all-gather the converted weights in FP8 (1 byte each), their "
        "scales computed once after each optimizer step (one all-reduce for all), instead of in the "
        "compute dtype.")


@dataclass
class Lora:
    rank: int = opt(
        0, "LoRA's rank r. Each adapted linear layer W [out, in] gains trainable A [r, in] and B [out, r] "
        "and computes x W^T + (alpha / r) x A^T B^T; every other parameter is frozen (no gradient, no "
        "optimizer state, no gradient reduction). A starts normal (std 1/sqrt(in)), B at zero: training "
        "starts from the base model. 0 = off (every parameter trained).")
    alpha: float = opt(16.0, "The adapters' scale numerator: their product is multiplied by alpha / rank.")
    dropout: float = opt(0.0, "Dropout probability on the adapters' input in training (0 <= p < 1).")
    modules: list = opt(["layers.*"], "Linear layers to adapt, as shell patterns (fnmatch) over their "
                                      "names ('layers.*.attention.*', 'layers.*.feed_forward.w2'); the "
                                      "embedding and the output head never are, nor a mixture of "
                                      "experts' stacked routed experts (no linear layers).")
    exclude: list = opt(["*.gate"], "Patterns of layers left unadapted among those modules match "
                                    "(default: a mixture of experts' routers).")
    save_base: bool = opt(
        False, "Checkpoints hold the adapters alone (and their optimizer state): a resume rebuilds the "
               "frozen base from checkpoint.initial_load_path, or from training.seed without one. true: "
               "also the base weights (in the compute dtype), so a resume needs neither.")


@dataclass
class Loss:
    z_loss: float = opt(
        0.0, "Coefficient of the z-loss, added to the cross-entropy: z_loss x logsumexp(logits)^2 per "
        "token, which keeps the softmax normalizer near 1 (PaLM: 1e-4); logged as loss/z_loss. 0 = off.")


@dataclass
class LRScheduler:
    warmup_steps: int = opt(30, "Linear warmup steps from ~0 to the peak lr.")
    decay_type: str = opt("cosine", "Decay after warmup.", ("cosine", "linear", "constant"))
    min_lr_ratio: float = opt(0.1, "Final lr as a fraction of the peak.")


@dataclass
class Parallelism:
    layout: str = opt(
        "manual", "'auto': the planner picks the degrees, ZeRO stage, recomputation, micro-batch and "
        "pipeline schedule for this world size, global batch, seq_len and device memory (or "
        "training.memory_cap_gib), from a measurement of this machine (cached per cluster), and prints the "
        "candidates; leave the fields it sets at their defaults. 'manual': the fields below as given.",
        ("manual", "auto"))
    auto_trials: int = opt(
        0, "With layout = 'auto': train the planner's best k layouts for auto_trial_steps steps each in "
        "this job, before the run, and keep the fastest measured (the log says whether the trials agreed "
        "with the planner); 0 = launch the planner's best.")
    auto_trial_steps: int = opt(4, "Steps of each trial (the first, which warms up, is not timed).")
    data_parallel_replicate_degree: int = opt(1, "Data-parallel replicas (HSDP outer dimension).")
    data_parallel_shard_degree: int = opt(
        -1, "Ranks that shard ZeRO state inside a replica; -1 = the ranks left over."
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree (innermost mesh dimension).")
    pipeline_parallel_degree: int = opt(1, "Pipeline stages over ranks (outermost mesh dimension).")
    context_parallel_degree: int = opt(
        1, "Context parallelism: each sequence split over this many ranks (head-tail chunks, so that causal "
        "attention costs each the same); they see the same batch, and ZeRO shards over dp_shard x this.")
    context_parallel_method: str = opt(
        "alltoall", "How attention sees the whole sequence under context parallelism: 'alltoall' trades the "
        "sequence split for a head split around attention (heads and KV heads, per TP rank, must divide by "
        "the degree); 'ring' keeps the heads and passes key/value blocks around the ranks, merging partial "
        "attention by log-sum-exp (any head count; no document masking; on GPUs seq_len a multiple of 64 x "
        "the degree).", ("alltoall", "ring"))
    expert_parallel_degree: int = opt(
        1, "Expert parallelism (mixture-of-experts models): each MoE block's experts split over this many "
        "ranks taken from the data_parallel_shard_degree ones (it must divide them and the expert count); "
        "tokens travel to their experts' ranks by an all-to-all and back, attention and the other weights "
        "stay data-parallel over those ranks, and ZeRO-3 shards the experts over the shard ranks left over. "
        "Needs zero_stage = 3.")
    zero_stage: int = opt(
        0,
        "0: DDP; 1: + optimizer states sharded; 2: + gradients sharded; 3: + parameters sharded (FSDP2).",
        (0, 1, 2, 3),
    )
    sequence_parallel: bool = opt(True, "With TP: norms and residual stream sharded along the sequence.")
    loss_parallel: bool = opt(True, "With TP: cross-entropy on vocab-sharded logits, never gathered.")
    zero3_reduce_every_microstep: bool = opt(
        True, "ZeRO-3 with gradient accumulation: reduce-scatter each micro-step's gradients, so only the "
        "shard is kept between micro-steps (one reduce-scatter per micro-step). false = accumulate full "
        "unsharded fp32 gradients on every rank and reduce once per step (fewer collectives; memory of a "
        "whole gradient per rank: 32 GB for an 8B model).")
    bucket_mb: float = opt(
        25.0, "ZeRO 0-2: gradients are reduced in buckets of this many MB (in the reduction dtype) while "
        "backward still runs, and stages 1-2 gather updated parameters in the same buckets. Larger buckets "
        "mean fewer, more efficient collectives; smaller ones start sooner and, under stage 2, hold less "
        "gradient memory (two buckets in flight). 25 = DDP's default. Unused under ZeRO-3 (a command-line "
        "value there is named; a config file's serves the ZeRO 0-2 layouts built on it).")
    cpu_offload: bool = opt(
        False, "ZeRO-3 only: parameters, gradients and optimizer step on the CPU (FSDP2 CPUOffloadPolicy)."
    )
    pipeline_parallel_schedule: str = opt("1F1B", "Schedule from torch.distributed.pipelining.")
    pipeline_parallel_microbatch_size: int = opt(
        1, "Sequences per pipeline microbatch; microbatches = local batch / this."
    )
    pipeline_parallel_stages_per_rank: int = opt(
        0, "Virtual stages per rank; 0 = 1 for single-stage schedules, 2 for multi-stage."
    )
    pipeline_parallel_layers_per_stage: list = opt(
        [], "Explicit split: layers in each stage, in stage order (must sum to n_layers); empty = balanced."
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log every N steps (step 1 always).")
    enable_tensorboard: bool = opt(False, "Write TensorBoard event files under <dump_folder>/tb (the keys of "
                                          "metrics.jsonl).")
    enable_wandb: bool = opt(False, "Log to Weights & Biases (set WANDB_MODE=offline without network); "
                                    "WANDB_PROJECT / WANDB_ENTITY / WANDB_RUN_NAME override the fields.")
    wandb_project: str = opt("torchpar", "wandb project.")
    wandb_run_name: str = opt("", "wandb run name; empty = wandb's own.")
    wandb_tags: list = opt([], "wandb tags (TOML list, or comma-separated on the command line).")
    peak_tflops: float = opt(
        0.0, "Peak TFLOP/s per device that MFU is measured against; 0 = the datasheet figure of a known GPU "
        "(for the training dtype), or a timed matmul on CPU.")
    log_step_breakdown: bool = opt(
        True, "On logged steps, time data loading, forward+backward, gradient reduction and clipping, and "
        "the optimizer step (the device is synchronized at their borders on those steps only).")
    predict_step_time: bool = opt(
        False, "Probe this machine before the model is built (its rate on the model's blocks and its "
        "collectives: seconds, cached per cluster; within training.memory_cap_gib) and log the planner's "
        "step time for it beside the measured one on every logged step (predicted_step_s, measured_step_s "
        "and their terms), warning once past prediction_margin. layout = 'auto' probes anyway, and logs "
        "them whether this is set or not.")
    prediction_margin: float = opt(
        1.0, "With the step time predicted (predict_step_time, or layout = 'auto'): warn once when the "
        "measured step time and the prediction differ by more than this share of the smaller (1.0: a "
        "factor of 2 either way), naming the term (compute, communication, pipeline bubble) that is off "
        "most; 0 = never warn.")
    log_communication: bool = opt(
        False, "On logged steps after the first, count the bytes each mesh dimension sends (a dispatch-mode "
        "ledger that slows the steps it counts); the planner's prediction is logged at step 1.")
    straggler_factor: float = opt(
        1.5, "With log_step_breakdown: on logged steps, compare each rank's own work — the phases no other "
        "rank takes part in: data loading and the optimizer step — with the median rank's, and name in one "
        "warning (and a 'straggler' record) a rank that takes more than this factor times the median, and "
        "50 ms more, on straggler_steps logged steps in a row (the others wait for it in every collective, "
        "so the step time alone cannot tell who it is). One all-gather of 2 numbers per rank; 0 = off.")
    straggler_steps: int = opt(3, "Logged steps in a row a rank must be slow on before it is named.")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Write torch.profiler Chrome traces of every rank to "
                                        "<dump_folder>/profiling/traces/iteration_N/.")
    profile_freq: int = opt(100, "Profile (and snapshot memory) every N steps.")
    profile_warmup: int = opt(1, "Steps the profiler runs before recording, in each period.")
    profile_active: int = opt(1, "Steps recorded in each period.")
    enable_memory_snapshot: bool = opt(
        False, "CUDA only: record allocations and write memory snapshots every profile_freq steps and on "
        "running out of memory, to <dump_folder>/profiling/memory_snapshot/.")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save DCP checkpoints and resume from the latest complete one at start.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder (or absolute).")
    interval: int = opt(500, "Save every N steps; the last step is always saved.")
    keep_latest_k: int = opt(
        0, "Keep only the newest K complete checkpoints (0 = keep all); the newest is never deleted."
    )
    async_mode: str = opt("off",
                          "'async' = stage to memory, write in a background thread while training goes on.",
                          ("off", "async"))
    load_step: int = opt(
        -1, "Step to resume from; -1 = the latest complete checkpoint (if any); 0 = never resume."
    )
    initial_load_path: str = opt(
        "", "Model-only weights to start from when no checkpoint exists yet: a `torchpar export` file, or a "
        "Hugging Face model folder (config.json + safetensors).")
    initial_load_format: str = opt(
        "auto", "Format of initial_load_path: 'torchpar' (an export file), 'hf' (a Hugging Face folder), "
        "'auto' = 'hf' for a folder with config.json.", ("auto", "torchpar", "hf"))
    save_on_signal: bool = opt(
        True, "On SIGTERM/SIGINT/SIGHUP (preemption, a closed terminal), finish the current step and save a "
        "checkpoint before exiting (exit code 128 + the signal's number).")
    verify_checksums: bool = opt(
        True,
        "Before loading, check every file's CRC32 against the manifest (reads the checkpoint once more); "
        "sizes are always checked.",
    )


@dataclass
class Validation:
    enable: bool = opt(False, "Measure the loss on held-out text every `freq` steps and after the last step.")
    freq: int = opt(100, "Steps between evaluations.")
    steps: int = opt(
        10,
        "Global batches per evaluation. Each evaluation reads the same windows from the start of the "
        "held-out stream, so successive values compare, and any layout gives the same number.",
    )
    split: str = opt(
        "validation", "Held-out split: 'validation' for the stdlib corpus; a split name for 'hf'."
    )
    path: str = opt(
        "",
        "For data.dataset = 'files' (required there): held-out .txt/.jsonl files or globs; for 'hf' another "
        "dataset; empty = data.path.",
    )


@dataclass
class Comm:
    timeout_s: int = opt(
        600, "Seconds a collective may wait for the other ranks before it fails (the process group's "
        "timeout); bounds checkpoint saves and loads, which the watchdog leaves alone.")
    watchdog_s: float = opt(
        120, "A rank that stops answering (stopped, frozen) or a step that makes no progress for this long "
        "(or for 3 x the last measured step, if longer; an evaluation: 3 steps' worth per held-out batch; "
        "each micro-batch counts as progress) ends the job with one line naming the rank and what it was "
        "doing, so the launcher's restart policy can take over; 0 = off. Must be below timeout_s.")


@dataclass
class FaultTolerance:
    enable: bool = opt(
        False, "Train as one of several replica groups through torchft: each group is a job of any layout, "
        "their gradients averaged every step over a process group torchft manages, a step committed by "
        "the groups a quorum holds; a lost group costs the others no restart. Needs torchft and its "
        "lighthouse (torchft_lighthouse).")
    replica_id: int = opt(0, "This replica group's index, 0 to replica_groups - 1 (its share of the data).")
    replica_groups: int = opt(1, "How many replica groups train together (the data is split among them).")
    min_replicas: int = opt(1, "The fewest replica groups a step commits with; with fewer it is not applied.")
    lighthouse: str = opt(
        "", "The torchft lighthouse's address (http://host:port); empty = the TORCHFT_LIGHTHOUSE variable.")
    timeout_s: float = opt(
        60.0, "Seconds torchft waits for a quorum, a cross-group collective or a commit before the step "
              "fails and is retried without the groups that did not answer.")
    semi_sync: str = opt(
        "off", "How the groups meet: 'off' averages their gradients every step (synchronous); 'localsgd' "
        "lets each group train on alone and averages their weights every sync_every steps; 'diloco' "
        "(DiLoCo) averages instead how far each group moved since the last sync and applies that as the "
        "gradient of an outer Nesterov SGD (outer_lr, outer_momentum) to the weights of the last sync. "
        "A sync that does not commit puts every group back to the weights of the last one.",
        ("off", "localsgd", "diloco"))
    sync_every: int = opt(20, "With localsgd or diloco: steps between syncs (H).")
    outer_lr: float = opt(0.7, "DiLoCo's outer learning rate.")
    outer_momentum: float = opt(0.9, "DiLoCo's outer Nesterov momentum (0 = plain SGD).")
    fragments: int = opt(
        1, "Streaming DiLoCo: the weights each rank holds are cut into this many equal runs (in parameter "
        "order), synced in turn, one every sync_every / fragments steps — each still every sync_every "
        "steps, with 1/fragments of the bytes at a time (sync_every must be a multiple).")
    fragment_alpha: float = opt(
        0.0, "Streaming DiLoCo: after a fragment's sync a group keeps this share of its own weights "
             "(0 = the synced weights alone, 1 = its own).")


@dataclass
class JobConfig:
    # (not a field: no TOML key) The dotted keys the command line set, filled by load_config. A
    # file's value is a base every layout built on the file shares (the self-test's bucket size
    # serves its ZeRO 0-2 layouts); an override is this run's own choice, so a check that finds one
    # with no effect names it.
    overridden = frozenset()

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    quantize: Quantize = field(default_factory=Quantize)
    lora: Lora = field(default_factory=Lora)
    loss: Loss = field(default_factory=Loss)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    profiling: Profiling = field(default_factory=Profiling)
