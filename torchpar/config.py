"""Typed job configuration: one dataclass per TOML section.

A config file may name a parent with ``extends = "other.toml"`` (relative to the file); the
child's keys override the parent's, chains are allowed, cycles are refused. Command-line
overrides ``--section.key value`` / ``--section.key=value`` come last and are typed from the
dataclass field. Every user mistake raises :class:`ConfigError` with one readable sentence.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A user mistake in a config file, an override or a layout; printed without a traceback."""


def opt(default: Any, help: str, choices: tuple | None = None):
    """A config field with its docstring (shown by ``--help``) and optional allowed values."""
    kw = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return field(metadata={"help": help, "choices": choices}, **kw)


DTYPES = ("float32", "bfloat16")


@dataclass
class Job:
    dump_folder: str = opt("./outputs", "Folder for metrics.jsonl, wandb files and checkpoints.")
    description: str = opt("torchpar job", "Free text describing the run; logged with the config.")


@dataclass
class Model:
    name: str = opt("llama3", "Model family: 'llama3' (RMSNorm, RoPE, GQA, SwiGLU) or 'gpt2' (learned positions, "
                    "LayerNorm, GELU MLP, biases).", ("llama3", "gpt2"))
    flavor: str = opt("debug", "Size preset of the family (FLAVORS in torchpar/models/<family>.py).")
    tokenizer_path: str = opt(
        "builtin",
        "tiktoken BPE rank file (Llama-3 tokenizer.model format); 'builtin' = the 4k vocabulary "
        "shipped in torchpar/assets, trained by scripts/train_tokenizer.py.",
    )
    n_layers: int = opt(0, "Override the flavour's layer count (0 keeps the flavour's).")


@dataclass
class Data:
    dataset: str = opt(
        "stdlib",
        "'stdlib' = the Python standard library's own sources (no download); 'files' = local "
        ".txt/.jsonl files or globs in `path`; 'hf' = a Hugging Face `datasets` dataset.",
        ("stdlib", "files", "hf"),
    )
    path: str = opt("", "For 'files': comma-separated paths or globs. For 'hf': dataset name or local path.")
    text_field: str = opt("text", "Key of the text in .jsonl records and HF rows.")
    split: str = opt("train", "'train' or the held-out 'validation' split of the stdlib corpus; HF split name for 'hf'.")
    lanes: int = opt(64, "Documents are read through this many interleaved streams so a batch mixes files; 1 = one file after another.")
    num_workers: int = opt(0, "StatefulDataLoader worker processes (0 = load in the training process).")


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
    mixed_precision_param: str = opt("float32", "Dtype of parameters in compute.", DTYPES)
    mixed_precision_reduce: str = opt("float32", "Dtype of gradient reduction across data-parallel ranks.", DTYPES)
    activation_checkpoint: str = opt("none", "Recompute each block's activations in backward.", ("none", "full"))
    compile: bool = opt(False, "torch.compile each transformer block.")


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer.", ("AdamW",))
    lr: float = opt(3e-3, "Peak learning rate.")
    beta1: float = opt(0.9, "Adam beta1.")
    beta2: float = opt(0.95, "Adam beta2.")
    eps: float = opt(1e-8, "Adam epsilon.")
    weight_decay: float = opt(0.1, "Decoupled weight decay.")
    implementation: str = opt(
        "auto", "'auto' = fused on CUDA, foreach elsewhere.", ("auto", "fused", "foreach", "for-loop")
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(30, "Linear warmup steps from ~0 to the peak lr.")
    decay_type: str = opt("cosine", "Decay after warmup.", ("cosine", "linear", "constant"))
    min_lr_ratio: float = opt(0.1, "Final lr as a fraction of the peak.")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "Data-parallel replicas (HSDP outer dimension).")
    data_parallel_shard_degree: int = opt(-1, "Ranks that shard ZeRO state inside a replica; -1 = the ranks left over.")
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree (innermost mesh dimension).")
    pipeline_parallel_degree: int = opt(1, "Pipeline stages over ranks (outermost mesh dimension).")
    zero_stage: int = opt(
        0,
        "0: DDP; 1: + optimizer states sharded; 2: + gradients sharded; 3: + parameters sharded (FSDP2).",
        (0, 1, 2, 3),
    )
    sequence_parallel: bool = opt(True, "With TP: norms and residual stream sharded along the sequence.")
    loss_parallel: bool = opt(True, "With TP: cross-entropy on vocab-sharded logits, never gathered.")
    cpu_offload: bool = opt(False, "ZeRO-3 only: parameters, gradients and optimizer step on the CPU (FSDP2 CPUOffloadPolicy).")
    pipeline_parallel_schedule: str = opt("1F1B", "Schedule from torch.distributed.pipelining.")
    pipeline_parallel_microbatch_size: int = opt(1, "Sequences per pipeline microbatch; microbatches = local batch / this.")
    pipeline_parallel_stages_per_rank: int = opt(0, "Virtual stages per rank; 0 = 1 for single-stage schedules, 2 for multi-stage.")
    pipeline_parallel_layers_per_stage: list = opt(
        [], "Explicit split: layers in each stage, in stage order (must sum to n_layers); empty = balanced."
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log every N steps (step 1 always).")
    enable_wandb: bool = opt(False, "Log to Weights & Biases (set WANDB_MODE=offline without network).")
    wandb_project: str = opt("torchpar", "wandb project.")
    wandb_run_name: str = opt("", "wandb run name; empty = wandb's own.")
    wandb_tags: list = opt([], "wandb tags (TOML list, or comma-separated on the command line).")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save DCP checkpoints and resume from the latest complete one at start.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder (or absolute).")
    interval: int = opt(500, "Save every N steps; the last step is always saved.")
    keep_latest_k: int = opt(0, "Keep only the newest K complete checkpoints (0 = keep all); the newest is never deleted.")
    async_mode: str = opt("off", "'async' = stage to memory, write in a background thread while training goes on.",
                          ("off", "async"))
    load_step: int = opt(-1, "Step to resume from; -1 = the latest complete checkpoint (if any); 0 = never resume.")
    initial_load_path: str = opt(
        "", "Model-only weights (a `torchpar export` file) to start from when no checkpoint exists yet.")
    verify_checksums: bool = opt(
        True, "Before loading, check every file's CRC32 against the manifest (reads the checkpoint once more); "
        "sizes are always checked.")


@dataclass
class Validation:
    enable: bool = opt(False, "Measure the loss on held-out text every `freq` steps and after the last step.")
    freq: int = opt(100, "Steps between evaluations.")
    steps: int = opt(10, "Global batches per evaluation. Each evaluation reads the same windows from the start of "
                         "the held-out stream, so successive values compare, and any layout gives the same number.")
    split: str = opt("validation", "Held-out split: 'validation' for the stdlib corpus; a split name for 'hf'.")
    path: str = opt("", "For data.dataset = 'files' (required there): held-out .txt/.jsonl files or globs; for 'hf' "
                        "another dataset; empty = data.path.")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)


def _sections() -> dict[str, type]:
    return get_type_hints(JobConfig)


def did_you_mean(word: str, options) -> str:
    by_lower = {str(o).lower(): str(o) for o in options}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1)
    return f" Did you mean '{by_lower[close[0]]}'?" if close else f" Known: {', '.join(sorted(map(str, options)))}."


def _coerce(where: str, value: Any, typ: Any, from_cli: bool) -> Any:
    """Convert ``value`` to ``typ`` (strings from the command line are parsed)."""
    bad = ConfigError(f"{where}: got {value!r} ({type(value).__name__}), expected {getattr(typ, '__name__', typ)}.")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in ("true", "false", "1", "0", "yes", "no"):
            return str(value).lower() in ("true", "1", "yes")
        raise bad
    if typ in (int, float):
        # A TOML float where an int is expected is refused (no silent truncation); bool is an int
        # subclass in Python but never a number here.
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int,) if typ is int else (int, float)):
            return typ(value)
        if from_cli:
            try:
                return typ(value)
            except ValueError:
                raise bad from None
        raise bad
    if typ is str:
        if isinstance(value, str):
            return value
        raise bad
    if typ is list or get_origin(typ) is list:
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
            value = [int(v) if v.lstrip("-").isdigit() else v for v in value]
        if isinstance(value, list):
            return value
        raise bad
    raise bad  # pragma: no cover


def _field_types(cls) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _read_toml(path: Path, chain: list[Path]) -> dict:
    """Read ``path`` and merge it over its ``extends`` ancestors."""
    path = path.resolve()
    if path in chain:
        loop = " -> ".join(str(p) for p in chain + [path])
        raise ConfigError(f"config 'extends' forms a cycle: {loop}")
    if not path.is_file():
        via = f" (extended by {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{via}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: 'extends' must be a file path string, got {parent!r}")
    merged = _read_toml(path.parent / parent, chain + [path])
    for section, values in data.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values
    return merged


def _apply(cfg: JobConfig, section: str, key: str, value: Any, from_cli: bool, origin: str) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"{origin}: unknown section [{section}].{did_you_mean(section, sections)}")
    types = _field_types(sections[section])
    if key not in types:
        raise ConfigError(f"{origin}: unknown key '{key}' in [{section}].{did_you_mean(key, types)}")
    where = f"{origin}: {section}.{key}"
    value = _coerce(where, value, types[key], from_cli)
    choices = next(f for f in dataclasses.fields(sections[section]) if f.name == key).metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where} = {value!r} is not one of {list(choices)}.{did_you_mean(str(value), [str(c) for c in choices])}")
    setattr(getattr(cfg, section), key, value)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``['--a.b', 'v', '--c.d=w']`` -> ``[('a.b', 'v'), ('c.d', 'w')]``."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key value or --section.key=value")
        if "=" in arg:
            k, v = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            k, v = arg[2:], args[i + 1]
            i += 2
        out.append((k, v))
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    """Build the job config: defaults <- file chain <- command-line overrides."""
    cfg = JobConfig()
    if path is not None:
        origin = str(path)
        for section, values in _read_toml(Path(path), []).items():
            if not isinstance(values, dict):
                raise ConfigError(f"{origin}: top-level key '{section}' must be a [section] table.{did_you_mean(section, _sections())}")
            for key, value in values.items():
                _apply(cfg, section, key, value, from_cli=False, origin=origin)
    for dotted, value in parse_overrides(overrides or []):
        section, _, key = dotted.partition(".")
        _apply(cfg, section, key, value, from_cli=True, origin="command line")
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Checks that need no world size; layout checks live in ParallelDims."""
    t = cfg.training
    for name in ("steps", "local_batch_size", "seq_len"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"training.{name} must be positive, got {getattr(t, name)}")
    if t.global_batch_size < 0:
        raise ConfigError(f"training.global_batch_size must be >= 0 (0 = no accumulation), got {t.global_batch_size}")
    if cfg.data.lanes <= 0 or cfg.data.num_workers < 0:
        raise ConfigError(f"data.lanes must be positive and data.num_workers >= 0 (got {cfg.data.lanes}, {cfg.data.num_workers})")
    if cfg.metrics.log_freq <= 0:
        raise ConfigError(f"metrics.log_freq must be positive, got {cfg.metrics.log_freq}")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {cfg.lr_scheduler.warmup_steps}")
    if not 0 <= cfg.lr_scheduler.min_lr_ratio <= 1:
        raise ConfigError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {cfg.lr_scheduler.min_lr_ratio}")
    if t.max_norm < 0:
        raise ConfigError(f"training.max_norm must be >= 0 (0 = no clipping), got {t.max_norm}")
    # Checked here so a bad value stops before launch instead of inside torch.optim on every rank.
    o = cfg.optimizer
    for name, ok, rule in (("lr", o.lr >= 0, ">= 0"), ("beta1", 0 <= o.beta1 < 1, "in [0, 1)"),
                           ("beta2", 0 <= o.beta2 < 1, "in [0, 1)"), ("eps", o.eps > 0, "> 0"),
                           ("weight_decay", o.weight_decay >= 0, ">= 0")):
        if not ok:
            raise ConfigError(f"optimizer.{name} must be {rule}, got {getattr(o, name)}")
    from torchpar.models import MODELS

    flavors = MODELS[cfg.model.name].flavors
    if cfg.model.flavor not in flavors:
        raise ConfigError(f"model.flavor = {cfg.model.flavor!r} is not a {cfg.model.name} flavour."
                          f"{did_you_mean(cfg.model.flavor, flavors)}")
    if cfg.model.n_layers < 0:
        raise ConfigError(f"model.n_layers must be >= 0 (0 keeps the flavour's), got {cfg.model.n_layers}")
    ck = cfg.checkpoint
    if ck.interval <= 0 or ck.keep_latest_k < 0 or ck.load_step < -1:
        raise ConfigError(f"checkpoint.interval must be positive, keep_latest_k >= 0 and load_step >= -1 "
                          f"(got {ck.interval}, {ck.keep_latest_k}, {ck.load_step})")
    if cfg.data.dataset != "stdlib" and not cfg.data.path:
        raise ConfigError(f"data.path is required when data.dataset = '{cfg.data.dataset}'")
    v = cfg.validation
    if v.freq <= 0 or v.steps <= 0:
        raise ConfigError(f"validation.freq and validation.steps must be positive (got {v.freq}, {v.steps})")
    if v.enable and cfg.data.dataset == "files" and not v.path:
        raise ConfigError("validation.path is required with data.dataset = 'files' (held-out files, not the training ones)")


def to_toml(cfg: JobConfig) -> str:
    """The merged config as TOML (what --print-config shows)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    lines = []
    for f in dataclasses.fields(cfg):
        lines.append(f"[{f.name}]")
        for k, v in dataclasses.asdict(getattr(cfg, f.name)).items():
            lines.append(f"{k} = {fmt(v)}")
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    """Every field with its type, default and docstring."""
    lines = ["Config fields (set in TOML or override with --section.key value):", ""]
    for section, cls in _sections().items():
        lines.append(f"[{section}]")
        types = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            tname = getattr(types[f.name], "__name__", str(types[f.name]))
            choices = f.metadata.get("choices")
            extra = f" One of {list(choices)}." if choices else ""
            lines.append(f"  --{section}.{f.name} ({tname}, default {default!r}): {f.metadata['help']}{extra}")
        lines.append("")
    return "\n".join(lines)
