"""What composes: the one table of feature values that cannot run together, and why.

Every feature of a job is a value on a dimension (:data:`DIMENSIONS`): the model family, the
optimizer and the dtype of its state, the ZeRO stage, tensor, pipeline, context and expert
parallelism, recomputation, compile, document masking, precision, FP8, CPU offload, the loss terms,
accumulation, evaluation, LoRA. Any values run together and train what one process trains, except
where a rule of :data:`RULES` says otherwise, in the one line a user reads (naming the fields and
the way out).

The trainer's check before launch (``resolve_layout``), the planner's search and
``parallelism.layout = "auto"``, and ``docs/compatibility.md`` all read this table; nothing
restates a rule elsewhere. A tested covering matrix (``torchpar.tools.matrix``) trains cells in
which every pair of values of any two dimensions meets at least once, each equal to one process
or refused here — so a rule taken out of the table is a cell that fails.

Checks of sizes (a degree that does not divide the heads, a sequence that does not split into
chunks) are not composition: they stay with what they measure (``parallel/layout.py``,
``parallel/pipeline.py``). This module imports nothing of torchpar's but its errors: the features
are facts the caller collects (``torchpar.parallel.layout.layout_features``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from torchpar.errors import ConfigError


@dataclass(frozen=True)
class Features:
    """One job's value on every dimension, as facts the rules read (defaults: the plain job)."""

    family: str = "llama3"  # model.name
    experts: bool = False  # the family routes tokens to experts (a mixture of experts)
    tied: bool = False  # the flavour ties its token embedding and output head
    mtp: bool = False  # multi-token prediction: its depths use the head again, on the last stage
    # model fields (set to non-zero) whose terms are computed over each whole sequence
    sequence_terms: tuple[str, ...] = ()
    # model fields (set) that make attention more than the ring computes (a sink, a sliding window)
    custom_attention: tuple[str, ...] = ()
    optimizer: str = "adamw"  # optimizer.name
    whole: bool = False  # its update needs whole matrices (orthogonalization, row/column factors)
    gathers: bool = False  # ...and it gathers a sharded matrix itself (Muon)
    # its step takes plain tensors only, no DTensor shard (torch's Rprop; expert parallelism needs
    # ZeRO-3, so the ZeRO rule covers its shards)
    plain: bool = False
    compact_state: bool = False  # it can keep its moments in another dtype (adamw, muon)
    state_dtype: str = "float32"  # optimizer.state_dtype
    zero: int = 0  # the effective ZeRO stage
    replicas: int = 1  # dp_replicate (HSDP when the stage shards)
    tp: int = 1
    pp: int = 1
    schedule: str = ""  # the pipeline schedule ("" without a pipeline)
    split_backward: bool = False  # it runs backward as separate input and weight passes
    cp: int = 1
    cp_method: str = "alltoall"
    ep: int = 1
    recompute: str = "none"  # training.activation_checkpoint: none | full | selective
    compile: bool = False
    document_masking: bool = False
    chat: bool = False  # conversations, the loss on the assistant's turns (data.format = 'chat')
    bf16: bool = False  # bf16 compute (training.mixed_precision_param)
    float8: str = "off"  # FP8 matmuls of the blocks' linear layers (quantize.float8)
    offload: bool = False  # parallelism.cpu_offload
    z_loss: bool = False
    accumulation: bool = False  # more than one micro-step per optimizer step (pp 1)
    evaluation: bool = False  # [validation] enabled
    lora: bool = False  # LoRA adapters trained on a frozen base (lora.rank > 0)
    device: str = "cpu"


# Each dimension and the features that carry its value: a rule names the dimensions it reads, and
# reads no feature of another (a test holds every rule to its word).
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "family": ("family", "experts", "tied", "mtp", "custom_attention"),
    "optimizer": ("optimizer", "whole", "gathers", "plain", "compact_state"),
    "optimizer_state": ("state_dtype",),
    "zero": ("zero", "replicas"),
    "tp": ("tp",),
    "pp": ("pp", "schedule", "split_backward"),
    "cp": ("cp", "cp_method"),
    "ep": ("ep",),
    "recompute": ("recompute",),
    "compile": ("compile",),
    "document_masking": ("document_masking",),
    "data_format": ("chat",),
    "precision": ("bf16",),
    "float8": ("float8",),
    "offload": ("offload",),
    "loss_terms": ("z_loss", "sequence_terms"),
    "accumulation": ("accumulation",),
    "evaluation": ("evaluation",),
    "lora": ("lora",),
}


@dataclass(frozen=True)
class Rule:
    """Values of ``dims`` that cannot run together: ``applies(features)`` says when, ``reason`` (a
    format string over the features' fields) why, and what to change."""

    dims: tuple[str, ...]
    applies: Callable[[Features], bool]
    reason: str

    def says(self, f: Features) -> str:
        return self.reason.format(**{k.name: getattr(f, k.name) for k in fields(f)},
                                  sequence_fields=" and ".join(f"model.{t}" for t in f.sequence_terms),
                                  attention_fields=" and ".join(f"model.{t}" for t in f.custom_attention))


RULES: tuple[Rule, ...] = (
    Rule(("optimizer", "optimizer_state"), lambda f: f.state_dtype != "float32" and not f.compact_state,
         "optimizer.state_dtype = {state_dtype!r}: optimizer.name = {optimizer!r} keeps its state in float32 "
         "(the moments of adamw and muon can be kept in bfloat16); set state_dtype = 'float32'"),
    Rule(("offload", "zero"), lambda f: f.offload and f.zero != 3,
         "parallelism.cpu_offload needs parallelism.zero_stage = 3 (FSDP2's CPUOffloadPolicy keeps "
         "the sharded state on the host; zero_stage is {zero}); set zero_stage = 3 or cpu_offload = false"),
    Rule(("optimizer", "offload"), lambda f: f.whole and f.offload,
         "optimizer.name = {optimizer!r} with parallelism.cpu_offload: the offloaded step runs element-wise "
         "optimizers only (adamw, a dotted element-wise torch.optim class); turn cpu_offload off"),
    *(Rule(("optimizer", dim), shards,
           "optimizer.name = {optimizer!r} steps plain tensors only (its in-place masked writes have no "
           f"DTensor rule), which {setting} keeps as DTensor shards; use {fix}, or another optimizer")
      for dim, shards, setting, fix in (
          ("zero", lambda f: f.plain and f.zero == 3, "zero_stage = {zero}", "zero_stage 0-2"),
          ("tp", lambda f: f.plain and f.tp > 1, "tensor_parallel_degree = {tp}",
           "tensor_parallel_degree = 1"))),
    Rule(("optimizer", "tp"), lambda f: f.whole and not f.gathers and f.tp > 1,
         "optimizer.name = {optimizer!r} updates whole matrices, which tensor_parallel_degree = {tp} keeps "
         "as DTensor shards; use tensor_parallel_degree = 1, an element-wise optimizer (adamw) or muon (it "
         "gathers them)"),
    Rule(("optimizer", "zero"), lambda f: f.whole and not f.gathers and f.zero == 3,
         "optimizer.name = {optimizer!r} updates whole matrices, which zero_stage = 3 keeps as DTensor "
         "shards; use zero_stage <= 2 (its buckets give each matrix whole to one rank), an element-wise "
         "optimizer (adamw) or muon (it gathers them)"),
    Rule(("ep", "family"), lambda f: f.ep > 1 and not f.experts,
         "parallelism.expert_parallel_degree = {ep}: the {family} family has no experts; set it to 1, or "
         "train a mixture of experts (model.name = 'moe')"),
    Rule(("ep", "zero"), lambda f: f.ep > 1 and f.zero != 3,
         "parallelism.expert_parallel_degree = {ep} needs parallelism.zero_stage = 3: the experts' "
         "gradients are reduced over fewer ranks than the other weights', which FSDP2 does per module and "
         "the flat ZeRO 0-2 buffer does not (zero_stage is {zero})"),
    Rule(("compile", "tp", "zero"), lambda f: f.compile and f.tp > 1 and f.zero < 3,
         "training.compile = true with tensor parallelism needs parallelism.zero_stage = 3 (zero stages "
         "0-2 keep TP shards in one flat buffer, which torch.compile cannot trace); use zero_stage = 3 or "
         "compile = false"),
    Rule(("compile", "tp", "recompute"), lambda f: f.compile and f.tp > 1 and f.recompute != "none",
         "training.compile = true with tensor parallelism and training.activation_checkpoint = "
         "{recompute!r} fails inside torch.compile (a checkpoint wrapper around DTensor code); drop one "
         "of the three"),
    Rule(("compile", "pp"), lambda f: f.compile and f.split_backward,
         "training.compile = true gives wrong gradients with {schedule}, whose backward is split into input "
         "and weight passes; set compile = false or use a schedule without the split (1F1B, "
         "Interleaved1F1B, GPipe, LoopedBFS)"),
    Rule(("recompute", "pp"), lambda f: f.recompute == "selective" and f.split_backward,
         "training.activation_checkpoint = 'selective' fails with {schedule}, whose backward is split into "
         "input and weight passes (torch lets a region's kept outputs serve one backward only); use "
         "'full' or a schedule without the split (1F1B, Interleaved1F1B, GPipe, LoopedBFS)"),
    Rule(("pp", "family"), lambda f: f.pp > 1 and f.tied,
         "tied embeddings put the same weight on the first and the last pipeline stage; pipeline "
         "parallelism needs an untied flavour"),
    Rule(("pp", "family"), lambda f: f.mtp and f.split_backward,
         "model.mtp_depth with {schedule}: torch's split backward groups each weight's gradient by the "
         "paths from the stage's input, and a weight on two paths (the head, which every prediction "
         "depth uses again) is traversed twice and fails; use a schedule without the split (1F1B, "
         "Interleaved1F1B, GPipe, LoopedBFS) or mtp_depth = 0"),
    Rule(("cp", "document_masking"), lambda f: f.cp > 1 and f.cp_method == "ring" and f.document_masking,
         "parallelism.context_parallel_method = 'ring' with data.document_masking = true: ring attention "
         "here keeps one causal mask over the window; use context_parallel_method = 'alltoall' (documents "
         "kept), or document_masking = false"),
    Rule(("cp", "family"), lambda f: f.cp > 1 and f.cp_method == "ring" and bool(f.custom_attention),
         "{attention_fields}: attention beyond what the ring's kernels compute (causal softmax over "
         "every rank's keys); use context_parallel_method = 'alltoall' (each rank then attends over the "
         "whole sequence for its heads), or leave {attention_fields} unset"),
    Rule(("cp", "family", "loss_terms"), lambda f: f.cp > 1 and bool(f.sequence_terms),
         "{sequence_fields}: the {family} family computes these terms per whole sequence, which context "
         "parallelism (context_parallel_degree = {cp}) splits over ranks; set them to 0 or the "
         "context-parallel degree to 1"),
)
assert all(d in DIMENSIONS for rule in RULES for d in rule.dims), "a rule names an unknown dimension"


def refusals(f: Features) -> list[str]:
    """Every rule's line that ``f`` breaks, in the table's order (empty: it composes)."""
    return [rule.says(f) for rule in RULES if rule.applies(f)]


def check(f: Features) -> None:
    """ConfigError with the first line of :func:`refusals`, if any."""
    lines = refusals(f)
    if lines:
        raise ConfigError(lines[0])
