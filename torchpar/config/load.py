"""Loading the job configuration: defaults <- TOML file chain <- command-line overrides.

A config file may name a parent with ``extends = "other.toml"`` (relative to the file); the
child's keys override the parent's, chains are allowed, cycles are refused. Command-line
overrides ``--section.key value`` / ``--section.key=value`` come last and are typed from the
dataclass field. Every user mistake raises :class:`ConfigError` with one readable sentence.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from torchpar.config.sections import JobConfig
from torchpar.errors import ConfigError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@functools.cache  # (read for every key of every config: the type hints are resolved once)
def _sections() -> dict[str, type]:
    return get_type_hints(JobConfig)


def _coerce(where: str, value: Any, typ: Any, from_cli: bool) -> Any:
    """Convert ``value`` to ``typ`` (strings from the command line are parsed)."""
    bad = ConfigError(
        f"{where}: got {value!r} ({type(value).__name__}), expected {getattr(typ, '__name__', typ)}."
    )
    if get_origin(typ) in (Union, types.UnionType):  # X | None: a field that may be left unset
        inner = [a for a in get_args(typ) if a is not type(None)]
        if from_cli and str(value).lower() in ("none", "unset"):
            return None
        return _coerce(where, value, inner[0], from_cli)
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
            number = typ(value)
        elif from_cli:
            try:
                number = typ(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
        if not math.isfinite(number):  # (TOML and float() both read nan and inf; no field means them)
            raise ConfigError(f"{where}: got {value!r}, not a finite number; give a finite value")
        return number
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
    if typ is dict:
        if from_cli and isinstance(value, str):
            value = _cli_table(where, value)
        if isinstance(value, dict):
            return value
        raise bad
    raise bad  # pragma: no cover


def _cli_table(where: str, text: str) -> dict:
    """``'a=1,b=[1,2],c="x"'`` from the command line as a table: a TOML inline table's inside, or
    comma-separated key=value pairs whose unquoted values may be bare strings (``c=x``)."""
    try:
        return tomllib.loads(f"v = {{{text}}}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{where}: {item!r} is not key=value (e.g. 'momentum=0.9,nesterov=true')")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value.strip()
    return out


@functools.cache
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
        raise ConfigError(
            f"{where} = {value!r} is not one of {list(choices)}."
            + did_you_mean(str(value), [str(c) for c in choices])
        )
    setattr(getattr(cfg, section), key, value)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``['--a.b', 'v', '--c.d=w']`` -> ``[('a.b', 'v'), ('c.d', 'w')]``."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.key value or --section.key=value"
            )
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
        _apply_table(cfg, _read_toml(Path(path), []), str(path))
    pairs = parse_overrides(overrides or [])
    for dotted, value in pairs:
        section, _, key = dotted.partition(".")
        _apply(cfg, section, key, value, from_cli=True, origin="command line")
    cfg.overridden = frozenset(dotted for dotted, _ in pairs)
    validate(cfg)
    return cfg


def _apply_table(cfg: JobConfig, table: dict, origin: str) -> None:
    for section, values in table.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{origin}: top-level key '{section}' must be a [section] "
                f"table.{did_you_mean(section, _sections())}"
            )
        for key, value in values.items():
            _apply(cfg, section, key, value, from_cli=False, origin=origin)


def config_from_text(text: str, origin: str) -> JobConfig:
    """A config held as TOML text (the snapshot :func:`to_toml` wrote into a checkpoint), checked
    like a file; ``origin`` names it in errors."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin}: not valid TOML ({e})") from None
    cfg = JobConfig()
    _apply_table(cfg, table, origin)
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Checks that need no world size; layout checks live in ParallelDims."""
    t = cfg.training
    for name in ("steps", "local_batch_size", "seq_len", "activation_checkpoint_every"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"training.{name} must be positive, got {getattr(t, name)}")
    if t.activation_checkpoint_every > 1 and t.activation_checkpoint != "full":
        raise ConfigError(f"training.activation_checkpoint_every = {t.activation_checkpoint_every} applies "
                          "to training.activation_checkpoint = 'full' only; set it to 1 or choose 'full'")
    if t.global_batch_size < 0:
        raise ConfigError(
            f"training.global_batch_size must be >= 0 (0 = no accumulation), got {t.global_batch_size}"
        )
    if cfg.data.lanes <= 0 or cfg.data.num_workers < 0:
        raise ConfigError(
            f"data.lanes must be positive and data.num_workers >= 0 (got {cfg.data.lanes}, "
            f"{cfg.data.num_workers})"
        )
    if cfg.metrics.log_freq <= 0:
        raise ConfigError(f"metrics.log_freq must be positive, got {cfg.metrics.log_freq}")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {cfg.lr_scheduler.warmup_steps}")
    if not 0 <= cfg.lr_scheduler.min_lr_ratio <= 1:
        raise ConfigError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {cfg.lr_scheduler.min_lr_ratio}")
    if t.max_norm < 0:
        raise ConfigError(f"training.max_norm must be >= 0 (0 = no clipping), got {t.max_norm}")
    if t.loss_spike_factor < 0 or t.loss_spike_window < 1:
        raise ConfigError("training.loss_spike_factor must be >= 0 and loss_spike_window >= 1 (got "
                          f"{t.loss_spike_factor}, {t.loss_spike_window})")
    # Checked here so a bad value stops before launch instead of inside torch.optim (or the router)
    # on every rank: (field, its value, whether it is allowed, the rule).
    o, m, mx = cfg.optimizer, cfg.model, cfg.metrics
    for name, value, ok, rule in (
            ("optimizer.lr", o.lr, o.lr >= 0, ">= 0"),
            ("optimizer.beta1", o.beta1, 0 <= o.beta1 < 1, "in [0, 1)"),
            ("optimizer.beta2", o.beta2, 0 <= o.beta2 < 1, "in [0, 1)"),
            ("optimizer.eps", o.eps, o.eps > 0, "> 0"),
            ("optimizer.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
            ("optimizer.muon_lr", o.muon_lr, o.muon_lr >= 0, ">= 0"),
            ("optimizer.embedding_lr_mult", o.embedding_lr_mult, o.embedding_lr_mult >= 0, ">= 0"),
            ("optimizer.head_lr_mult", o.head_lr_mult, o.head_lr_mult >= 0, ">= 0"),
            ("model.capacity_factor", m.capacity_factor, m.capacity_factor >= 0, ">= 0 (0 = dropless)"),
            ("model.balance_coeff", m.balance_coeff, m.balance_coeff >= 0, ">= 0 (0 = no balance loss)"),
            ("model.bias_rate", m.bias_rate, m.bias_rate >= 0, ">= 0 (0 = no bias balancing)"),
            ("model.mtp_weight", m.mtp_weight, 0 <= m.mtp_weight <= 10, "in [0, 10] (0 = the flavour's 0.3)"),
            ("model.swiglu_limit", m.swiglu_limit, 0 <= m.swiglu_limit <= 1e4, "in [0, 1e4] (gpt-oss: 7)"),
            ("training.memory_cap_gib", t.memory_cap_gib, t.memory_cap_gib >= 0, ">= 0 (0 = no cap)"),
            ("metrics.straggler_factor", mx.straggler_factor,
             mx.straggler_factor == 0 or 1 < mx.straggler_factor <= 1000, "0 (off) or in (1, 1000]"),
            ("metrics.straggler_steps", mx.straggler_steps, 1 <= mx.straggler_steps <= 10**6, "in [1, 1e6]"),
            ("lora.rank", cfg.lora.rank, 0 <= cfg.lora.rank <= 65536,
             "in [0, 65536] (0 = off; 8 to 64 is usual)"),
            ("lora.alpha", cfg.lora.alpha, 0 < cfg.lora.alpha <= 1e6, "in (0, 1e6] (often 2 x rank)"),
            ("lora.dropout", cfg.lora.dropout, 0 <= cfg.lora.dropout < 1, "in [0, 1)")):
        if not ok:
            raise ConfigError(f"{name} must be {rule}, got {value}")
    p = cfg.parallelism
    if p.auto_trials < 0 or p.auto_trial_steps < 2:
        raise ConfigError("parallelism.auto_trials must be >= 0 and auto_trial_steps >= 2 (the first step "
                          f"warms up; got {p.auto_trials}, {p.auto_trial_steps})")
    if p.auto_trials and p.layout != "auto":
        raise ConfigError(f"parallelism.auto_trials = {p.auto_trials} needs parallelism.layout = 'auto'")
    if not cfg.metrics.prediction_margin >= 0:
        raise ConfigError(f"metrics.prediction_margin must be >= 0 (0 = never warn), got "
                          f"{cfg.metrics.prediction_margin}")
    if m.mtp_depth >= t.seq_len:
        raise ConfigError(f"model.mtp_depth = {m.mtp_depth} needs training.seq_len > {m.mtp_depth} (got "
                          f"{t.seq_len}): depth k predicts the token k + 1 ahead inside the window")
    ft = cfg.fault_tolerance
    if ft.enable and not (1 <= ft.min_replicas <= ft.replica_groups and 0 <= ft.replica_id < ft.replica_groups
                          and ft.replica_groups <= 4096 and 1 <= ft.timeout_s <= 86400):
        raise ConfigError(
            f"fault_tolerance: replica_groups = {ft.replica_groups}, replica_id = {ft.replica_id}, "
            f"min_replicas = {ft.min_replicas}, timeout_s = {ft.timeout_s:g}; need 1 <= min_replicas <= "
            "replica_groups <= 4096, 0 <= replica_id < replica_groups and timeout_s in [1, 86400]")
    if ft.enable and not (1 <= ft.sync_every <= 10**6 and 0 < ft.outer_lr <= 10
                          and 0 <= ft.outer_momentum < 1):
        raise ConfigError(f"fault_tolerance: sync_every = {ft.sync_every}, outer_lr = {ft.outer_lr:g}, "
                          f"outer_momentum = {ft.outer_momentum:g}; need sync_every in [1, 1e6], outer_lr in "
                          "(0, 10] and outer_momentum in [0, 1)")
    if ft.enable and cfg.parallelism.layout == "auto":
        raise ConfigError("fault_tolerance.enable = true with parallelism.layout = 'auto': each replica "
                          "group would pick its own layout from its own machine's measurement, and the "
                          "groups average their pieces position by position; set the layout (torchpar plan "
                          "shows the planner's choice) and parallelism.layout = 'manual'")
    if ft.enable and ft.semi_sync == "off" and (ft.fragments != 1 or ft.fragment_alpha != 0):
        raise ConfigError(f"fault_tolerance.fragments = {ft.fragments}, fragment_alpha = "
                          f"{ft.fragment_alpha:g} stream DiLoCo's or LocalSGD's meetings: set "
                          "fault_tolerance.semi_sync = 'diloco' (or 'localsgd'), or leave them at 1 and 0")
    if ft.enable and not (1 <= ft.fragments <= ft.sync_every and ft.sync_every % ft.fragments == 0
                          and 0 <= ft.fragment_alpha <= 1):
        raise ConfigError(f"fault_tolerance: fragments = {ft.fragments}, sync_every = {ft.sync_every}, "
                          f"fragment_alpha = {ft.fragment_alpha:g}; need sync_every a multiple of fragments "
                          "(1 = every weight at each sync) and fragment_alpha in [0, 1]")
    if not (0 <= cfg.loss.z_loss < 1):  # (NaN fails both)
        raise ConfigError(f"loss.z_loss must be in [0, 1) (1e-4 is usual), got {cfg.loss.z_loss}")
    _validate_files_and_runtime(cfg)


def _validate_files_and_runtime(cfg: JobConfig) -> None:
    """[checkpoint], [data] paths, [validation], [comm] and [profiling]."""
    ck = cfg.checkpoint
    if ck.interval <= 0 or ck.keep_latest_k < 0 or ck.load_step < -1:
        raise ConfigError("checkpoint.interval must be positive, keep_latest_k >= 0 and load_step >= -1 "
                          f"(got {ck.interval}, {ck.keep_latest_k}, {ck.load_step})")
    if cfg.data.dataset != "stdlib" and not cfg.data.path and not cfg.data.sources:
        raise ConfigError(f"data.path is required when data.dataset = '{cfg.data.dataset}'")
    v = cfg.validation
    if v.freq <= 0 or v.steps <= 0:
        raise ConfigError(f"validation.freq and validation.steps must be positive (got {v.freq}, {v.steps})")
    if v.enable and cfg.data.dataset in ("files", "tokenized") and not v.path:
        raise ConfigError(f"validation.path is required with data.dataset = '{cfg.data.dataset}' (held-out "
                          "documents, not the training ones)")
    pr = cfg.profiling
    if not (pr.profile_warmup >= 0 and pr.profile_active >= 1
            and pr.profile_freq >= pr.profile_warmup + pr.profile_active):
        raise ConfigError("profiling.profile_freq must be >= profile_warmup + profile_active, warmup >= 0 "
                          f"and active >= 1 (got {pr.profile_freq}, {pr.profile_warmup}, "
                          f"{pr.profile_active})")
    c = cfg.comm
    if c.timeout_s < 1 or not 0 <= c.watchdog_s < c.timeout_s or 0 < c.watchdog_s < 2:
        raise ConfigError(f"comm.timeout_s must be >= 1 and comm.watchdog_s 0 (off) or in [2, timeout_s) "
                          f"(got {c.timeout_s}, {c.watchdog_s:g})")


def to_toml(cfg: JobConfig) -> str:
    """The merged config as TOML (what --print-config shows)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {fmt(x)}" for k, x in v.items()) + "}"
        return repr(v)

    lines = []
    for f in dataclasses.fields(cfg):
        lines.append(f"[{f.name}]")
        for k, v in dataclasses.asdict(getattr(cfg, f.name)).items():
            if v is not None:  # (TOML has no null: an unset field is left out)
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
            lines.append(
                f"  --{section}.{f.name} ({tname}, default {default!r}): {f.metadata['help']}{extra}"
            )
        lines.append("")
    return "\n".join(lines)
