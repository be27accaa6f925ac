"""``torchpar config from-deepspeed ds_config.json``: a DeepSpeed config as a torchpar TOML.

    torchpar config from-deepspeed ds_config.json [--model FLAVOR] [--nproc N] > my.toml

Maps the batch arithmetic (DeepSpeed's rule: train_batch_size = micro-batch x accumulation x data-
parallel ranks, checked, with "auto" values solved from the others and ``--nproc``), the ZeRO
stage and offload, bf16, the AdamW optimizer, the three warmup schedulers, gradient clipping and
steps_per_print. Every key it does not map is listed with the reason, as a comment at the top of
the TOML and on stderr. The result is loaded and validated like any config before it is printed.
"""

from __future__ import annotations

from torchpar.config import load_config, to_toml
from torchpar.errors import ConfigError

# Keys DeepSpeed users often set that have no torchpar counterpart, and why.
NO_KNOB = ("torchpar's engines have no such setting (overlap is always on; stages 1-2 gather in the "
           "reduction's buckets)")
IGNORED_ZERO = ("allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
                "contiguous_gradients", "round_robin_gradients", "sub_group_size",
                "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save")


JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}
# Keys whose value DeepSpeed reads as an object of settings, and the objects inside them.
SECTIONS = {"zero_optimization": ("offload_optimizer", "offload_param"), "fp16": (), "bf16": (),
            "optimizer": ("params",), "scheduler": ("params",)}


def require_object(where: str, value) -> None:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a JSON object {{...}}, not a JSON "
                          f"{JSON_TYPES.get(type(value), type(value).__name__)}")


def _check_sections(ds: dict) -> None:
    """Each section (and its params / offload settings) is an object: one line naming the first
    that is not, instead of a failure deep inside the mapping."""
    for key, inner in SECTIONS.items():
        if ds.get(key) is not None:
            require_object(key, ds[key])
            for sub in inner:
                if ds[key].get(sub) is not None:
                    require_object(f"{key}.{sub}", ds[key][sub])


def _batch(ds: dict, nproc: int, out: list[str], notes: list[tuple[str, str]]) -> None:
    """train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x nproc."""
    tbs, mbs, gas = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps"))
    known = {k: v for k, v in (("tbs", tbs), ("mbs", mbs), ("gas", gas)) if v not in (None, "auto")}
    if any(not isinstance(v, int) or v <= 0 for v in known.values()):
        raise ConfigError(f"batch sizes must be positive integers or \"auto\", got {known}")
    if len(known) < 2 and "mbs" not in known:
        raise ConfigError("give train_micro_batch_size_per_gpu, or two of train_batch_size / "
                          "train_micro_batch_size_per_gpu / gradient_accumulation_steps")
    mbs = known.get("mbs") or known["tbs"] // (known["gas"] * nproc)
    gas = known.get("gas") or (known["tbs"] // (mbs * nproc) if "tbs" in known else 1)
    tbs = known.get("tbs") or mbs * gas * nproc
    if tbs != mbs * gas * nproc:
        raise ConfigError(f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mbs} x "
                          f"gradient_accumulation_steps {gas} x {nproc} ranks (--nproc); DeepSpeed refuses "
                          "this too")
    out += ["--training.local_batch_size", str(mbs), "--training.global_batch_size", str(tbs)]


def _zero(ds: dict, out: list[str], notes: list[tuple[str, str]]) -> None:
    z = ds.get("zero_optimization", {})
    stage = int(z.get("stage", 0))
    out += ["--parallelism.zero_stage", str(stage)]
    for key in ("offload_optimizer", "offload_param"):
        device = (z.get(key) or {}).get("device", "none")
        if device == "cpu" and stage == 3:
            out += ["--parallelism.cpu_offload", "true"]
        elif device != "none":
            notes.append(
                (f"zero_optimization.{key}.device = {device!r}",
                 "torchpar offloads to the CPU with ZeRO-3 only (FSDP2's CPUOffloadPolicy); no NVMe")
            )
    mapped = {"stage", "offload_optimizer", "offload_param"}
    if "reduce_bucket_size" in z and stage < 3:  # elements; torchpar's buckets are MB of fp32 gradients
        out += ["--parallelism.bucket_mb", str(float(z["reduce_bucket_size"]) * 4 / 2**20)]
        mapped.add("reduce_bucket_size")
    for key in sorted(set(z) - mapped):
        notes.append((f"zero_optimization.{key}", NO_KNOB if key in IGNORED_ZERO else "not mapped"))


def _precision(ds: dict, out: list[str], notes: list[tuple[str, str]]) -> None:
    if (ds.get("fp16") or {}).get("enabled"):
        notes.append(("fp16.enabled", "torchpar has no fp16 loss scaling; use bf16 or fp32"))
    # Spelled out either way: torchpar's own default ('auto') is bf16 on GPUs.
    bf16 = bool((ds.get("bf16") or {}).get("enabled"))
    out += ["--training.mixed_precision_param", "bfloat16" if bf16 else "float32"]


def _optimizer(ds: dict, out: list[str], notes: list[tuple[str, str]]) -> None:
    opt = ds.get("optimizer")
    if not opt:
        return
    params = opt.get("params", {})
    if opt.get("type", "").lower() not in ("adamw", "adam"):
        notes.append((f"optimizer.type = {opt.get('type')!r}", "only Adam and AdamW are translated: set "
                      "[optimizer] name (adamw, muon, adafactor or a torch.optim class) by hand"))
        return
    # DeepSpeed's optimizer decays every parameter it is given; torchpar's groups spare vectors
    # and embeddings unless told otherwise.
    out += ["--optimizer.decay_all", "true"]
    if opt.get("type", "").lower() == "adam" and params.get("adam_w_mode") is False:
        notes.append(("optimizer.params.adam_w_mode = false", "torchpar's weight decay is decoupled (AdamW)"))
    for key, field in (("lr", "lr"), ("eps", "eps"), ("weight_decay", "weight_decay")):
        if key in params and params[key] != "auto":
            out += [f"--optimizer.{field}", str(params[key])]
    if isinstance(params.get("betas"), list) and len(params["betas"]) == 2:
        out += ["--optimizer.beta1", str(params["betas"][0]), "--optimizer.beta2", str(params["betas"][1])]
    for key in sorted(set(params) - {"lr", "eps", "weight_decay", "betas", "adam_w_mode"}):
        notes.append((f"optimizer.params.{key}", "not mapped"))


def _scheduler(ds: dict, out: list[str], notes: list[tuple[str, str]]) -> None:
    sched = ds.get("scheduler")
    if not sched:
        return
    kind, p = sched.get("type"), sched.get("params", {})
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        notes.append((f"scheduler.type = {kind!r}", "torchpar has linear warmup + cosine/linear/constant "
                                                    "decay"))
        return
    if "warmup_num_steps" in p:
        out += ["--lr_scheduler.warmup_steps", str(p["warmup_num_steps"])]
    if p.get("warmup_type", "log") != "linear":
        notes.append(("scheduler.params.warmup_type", "torchpar warms up linearly (DeepSpeed's default is "
                                                      "log)"))
    if kind == "WarmupLR":
        out += ["--lr_scheduler.decay_type", "constant"]
        if "warmup_max_lr" in p:
            out += ["--optimizer.lr", str(p["warmup_max_lr"])]
    elif kind == "WarmupDecayLR":
        out += ["--lr_scheduler.decay_type", "linear", "--lr_scheduler.min_lr_ratio", "0"]
        if "warmup_max_lr" in p:
            out += ["--optimizer.lr", str(p["warmup_max_lr"])]
    else:
        out += ["--lr_scheduler.decay_type", "cosine", "--lr_scheduler.min_lr_ratio",
                str(p.get("cos_min_ratio", 0.0001))]
    if "total_num_steps" in p:
        out += ["--training.steps", str(p["total_num_steps"])]
    for key in ("warmup_min_lr", "warmup_min_ratio"):
        if p.get(key):
            notes.append((f"scheduler.params.{key}", "torchpar's warmup starts at lr / (warmup_steps + 1)"))


def convert(ds: dict, nproc: int, flavor: str | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(TOML text, [(unmapped key, reason)]) for the DeepSpeed config ``ds`` on ``nproc`` ranks."""
    out: list[str] = ["--model.flavor", flavor] if flavor else []
    notes: list[tuple[str, str]] = []
    _check_sections(ds)
    _batch(ds, nproc, out, notes)
    _zero(ds, out, notes)
    _precision(ds, out, notes)
    _optimizer(ds, out, notes)
    _scheduler(ds, out, notes)
    if "gradient_clipping" in ds:
        out += ["--training.max_norm", str(ds["gradient_clipping"])]
    if "steps_per_print" in ds:
        out += ["--metrics.log_freq", str(ds["steps_per_print"])]
    mapped = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "zero_optimization", "fp16", "bf16", "optimizer", "scheduler", "gradient_clipping",
              "steps_per_print"}
    notes += [(key, "not mapped") for key in sorted(set(ds) - mapped)]
    cfg = load_config(None, out)  # validated like any config
    header = [f"# From a DeepSpeed config for {nproc} rank(s) by `torchpar config from-deepspeed`."]
    header += [f"# not mapped: {key}: {why}" for key, why in notes]
    return "\n".join(header) + "\n\n" + to_toml(cfg), notes
