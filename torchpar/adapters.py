"""LoRA checkpoints outside training: the model they stand for, merged, and PEFT's adapter format.

A LoRA run's checkpoint holds its adapters (and, with ``lora.save_base``, the frozen base). The
model it stands for is the base with each adapted layer's weight replaced by ``W + (alpha / r) B A``
(``models.lora.merged``); the base comes from where the run took it: the checkpoint itself, the
``checkpoint.initial_load_path`` it started from (a Hugging Face folder or a torchpar export), or
the seed it was initialized from. :func:`open_merged` reads that model one tensor at a time, as
:func:`torchpar.weights.open_source` reads a plain checkpoint, so ``torchpar export`` (both
formats) and ``torchpar generate`` take LoRA checkpoints as they are. :func:`write_peft` writes the
adapters alone as PEFT loads them (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from torchpar.config import JobConfig, config_from_text
from torchpar.errors import ConfigError
from torchpar.models import DEFAULT_FAMILY, adapter
from torchpar.models.lora import A, B, adapted_layers, merged, scale, spec
from torchpar.outputs import read_marker, replacing, write_marker, write_text
from torchpar.preflight import initial_weights, saved_config, saved_generator, seeded_base_problem
from torchpar.weights import open_source

PEFT_COMMAND = "torchpar export --format peft"
# PEFT (0.21, with transformers 5) reads targets of these names in a mixture of experts as the fused
# experts' stacked parameters, whatever layer they name: a dense block's MLP adapters would be lost.
MOE_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def saved_job(meta: dict, where: str) -> JobConfig | None:
    """The config a checkpoint was trained with (its manifest's snapshot), None where it holds none
    (an export file)."""
    text = meta.get("config")
    return config_from_text(text, f"{where}'s config snapshot") if text else None


def _base_reader(meta: dict, cfg: JobConfig, read, where: str):
    """``base(name)``: a frozen base weight, full, from where the run took it (a saved base in the
    dtype it was held in; otherwise fp32)."""
    family = adapter(meta.get("model_name", DEFAULT_FAMILY))
    args = family.args_class(**meta["model_args"])
    if cfg.lora.save_base:
        return read
    if cfg.checkpoint.initial_load_path:
        weights = initial_weights(cfg, family, args)
        return lambda name: weights[name].read()
    device = meta.get("device", "cpu")
    problem = seeded_base_problem(saved_generator(meta), on_cpu=True)
    if problem:
        raise ConfigError(f"{where} holds LoRA adapters whose base {problem}")
    with torch.device("meta"):
        model = family.build(args)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return lambda name: model.initial_value(name, shapes[name], cfg.training.seed, device).cpu()


def open_merged(path: str | Path) -> tuple[dict, object]:
    """:func:`torchpar.weights.open_source` for any checkpoint or export: for a LoRA checkpoint,
    ``read(name)`` gives the merged model's tensors (an adapted layer's weight with its adapters
    folded in; the base's others as they were; the adapters themselves under their own names)."""
    meta, read = open_source(path)
    if not saved_config(meta).get("lora", {}).get("rank", 0):
        return meta, read  # (no adapters: the checkpoint is the model; its config is not even read)
    cfg = saved_job(meta, str(path))
    family = adapter(meta.get("model_name", DEFAULT_FAMILY))
    args = family.args_class(**meta["model_args"])
    adapted = adapted_layers(family, args, spec(cfg.lora))
    base, factor = _base_reader(meta, cfg, read, str(path)), scale(cfg.lora)

    def merged_read(name: str) -> torch.Tensor:
        layer, _, leaf = name.rpartition(".")
        try:
            value = read(name)  # (the adapters, the state beside the weights, a saved base)
        except KeyError:
            value = base(name)
        if leaf == "weight" and layer in adapted:
            return merged(value, read(f"{layer}.{A}"), read(f"{layer}.{B}"), factor)
        return value

    meta = {**meta, "lora": {"spec": spec(cfg.lora), "alpha": cfg.lora.alpha, "dropout": cfg.lora.dropout,
                             "base": cfg.checkpoint.initial_load_path}}
    return meta, merged_read


def peft_adapters(family, args, lora_spec: tuple, alpha: float, dropout: float, read,
                  base: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    """(adapter_model.safetensors' tensors, adapter_config.json) of the adapters ``read(name)`` gives
    for a model of adapter ``family`` with ``args`` (:func:`torchpar.models.lora.spec`
    ``lora_spec``): each adapted layer's A and B under its Hugging Face module's name, B's rows
    permuted as the weight's are (RoPE's head layout); ``base``: the model they adapt, if named."""
    problem = family.hf_problem(args)
    if problem:
        raise ConfigError(f"{problem}; export the merged model with --format torchpar")
    by_weight = {tp: (hf, how) for tp, hf, how in family.hf_tensors(args)}
    layers = {}  # torchpar layer -> (its HF module, how its rows are laid out); every one checked first
    for layer in adapted_layers(family, args, lora_spec):
        hf, how = by_weight.get(f"{layer}.weight", (None, None))
        if hf is None or not (how is None or isinstance(how, int)):
            raise ConfigError(f"{layer}'s weight is part of a fused Hugging Face tensor ({hf}), which PEFT "
                              "adapts as one; export the merged model with --format hf")
        module = hf.removesuffix(".weight")
        if family.experts(args) and module.rpartition(".")[2] in MOE_EXPERT_NAMES:
            raise ConfigError(f"{layer} is {module} in Hugging Face's form, and PEFT reads a mixture of "
                              f"experts' {'/'.join(MOE_EXPERT_NAMES)} targets as its fused experts, so "
                              "these adapters would be applied elsewhere; adapt the attention alone for a "
                              "PEFT export (lora.modules = ['layers.*.attention.*']), or export the merged "
                              "model with --format hf")
        layers[layer] = module, how
    tensors = {}
    for layer, (module, how) in layers.items():
        b = read(f"{layer}.{B}")
        tensors[f"base_model.model.{module}.lora_A.weight"] = read(f"{layer}.{A}")
        tensors[f"base_model.model.{module}.lora_B.weight"] = family.to_hf(b, how) if how is not None else b
    targets = [module for module, _ in layers.values()]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_spec[0], "lora_alpha": alpha,
              "lora_dropout": dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "inference_mode": True, "modules_to_save": None, "init_lora_weights": True,
              "base_model_name_or_path": base or None}
    return tensors, config


def write_peft(path: str | Path, out: Path, dtype: torch.dtype) -> str:
    """The adapters of LoRA checkpoint ``path`` in PEFT's format (:func:`peft_adapters`), into
    folder ``out``."""
    from safetensors.torch import save_file

    meta, read = open_merged(path)
    if "lora" not in meta:
        raise ConfigError(f"{path} holds no LoRA adapters (lora.rank = 0); export the model with --format hf "
                          "or torchpar")
    family = adapter(meta.get("model_name", DEFAULT_FAMILY))
    args = family.args_class(**meta["model_args"])
    lora = meta["lora"]
    tensors, config = peft_adapters(family, args, lora["spec"], lora["alpha"], lora["dropout"], read,
                                    lora["base"])
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, PEFT_COMMAND, list(PEFT_FILES))  # (the same two files every time)
    with replacing(out / PEFT_FILES[1]) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_text(out / PEFT_FILES[0], json.dumps(config, indent=2) + "\n")
    n = sum(t.numel() for t in tensors.values())
    layers = len(config["target_modules"])
    return f"{layers} adapted layers, {n / 1e6:.3f}M adapter parameters (rank {config['r']})"


def is_own_peft(folder: Path) -> bool:
    """A folder an earlier PEFT export wrote (it may be written again)."""
    return read_marker(folder, PEFT_COMMAND) is not None

