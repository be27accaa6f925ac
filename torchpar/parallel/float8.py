"""FP8 training through torchao: which linear layers run their matmuls in FP8 ([quantize]), and
the scales FSDP2's FP8 all-gather needs after each optimizer step.

The layers are converted on the meta model before any parallelism, by torchao's
``convert_to_float8_training``: its ``Float8Linear`` is an ``nn.Linear`` whose forward and backward
cast each matmul's operands to FP8 with dynamic scales (one per tensor, or one per row). Its
weight stays the parameter it was, under the same name, so the TP plans, the ZeRO engines, the
checkpoints and the Hugging Face mapping see the model they know; the model's code holds no
quantization. A mixture of experts' stacked expert weights run through grouped GEMM, not
``nn.Linear``: they stay in the compute dtype (torchao's grouped FP8 path is a prototype).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from fnmatch import fnmatch

import torch
from torch import nn

from torchpar.errors import ConfigError


def too_small(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether FP8 is slower than the compute dtype for a layer of this size, by torchao's rule
    (measured on H100: the casts cost more than the faster matmul gains)."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def float8_layers(module: nn.Module, model, q) -> list[tuple[str, nn.Linear]]:
    """The linear layers of ``module`` (of adapter ``model``) that [quantize] ``q`` names (by
    ``modules``, not by ``exclude``), never one under the embedding or the head (the adapter's
    first_stage and last_stage modules), nor, with ``skip_small``, one too small to gain."""
    keep_out = (*model.first_stage, *model.last_stage)
    out = []
    for name, m in module.named_modules():
        if type(m) is not nn.Linear or name.split(".")[0] in keep_out:
            continue
        if not any(fnmatch(name, p) for p in q.modules) or any(fnmatch(name, p) for p in q.exclude):
            continue
        if q.skip_small and too_small(q.float8, m.out_features, m.in_features):
            continue
        out.append((name, m))
    return out


def converted_layers(model, args, q) -> tuple[tuple[str, int, int], ...]:
    """(name, out features, in features) of each linear layer [quantize] ``q`` converts in a model
    of adapter ``model`` with ``args`` (:func:`float8_layers`; none when FP8 is off), read from one
    meta model per job, which the start-up check and the planner share."""
    if q is None or q.float8 == "off":
        return ()
    return _layers(model, args, q.float8, tuple(q.modules), tuple(q.exclude), q.skip_small)


@functools.lru_cache(maxsize=32)
def _layers(model, args, recipe: str, modules: tuple, exclude: tuple,
            skip_small: bool) -> tuple[tuple[str, int, int], ...]:
    q = types.SimpleNamespace(float8=recipe, modules=modules, exclude=exclude, skip_small=skip_small)
    with torch.device("meta"):
        module = model.build(args)
    return tuple((name, m.out_features, m.in_features) for name, m in float8_layers(module, model, q))


def float8_weights(model, args, lay) -> dict[str, int]:
    """Elements of each weight whose matmuls run in FP8 under layout ``lay``, by canonical name
    (the planner's FLOPs at the FP8 peak); empty without FP8."""
    return {f"{name}.weight": n * k for name, n, k in converted_layers(model, args, lay.quantize)}


def gathered_in_float8(model, args, lay) -> frozenset[str]:
    """Canonical names of the weights ZeRO-3 all-gathers in FP8 under layout ``lay`` (the
    planner's bytes in flight: 1 per element), none without FP8 all-gather."""
    return frozenset(float8_weights(model, args, lay)) if lay.float8_all_gather else frozenset()


def check_float8(model, args, q) -> list[str]:
    """The names of the layers [quantize] ``q`` converts in a model of adapter ``model`` with
    ``args``; one line for a layer FP8 matmuls cannot take, or torchao missing."""
    layers = converted_layers(model, args, q)
    for name, n, k in layers:
        if n % 16 or k % 16:
            raise ConfigError(
                f"quantize.float8 = {q.float8!r}: layer {name} is {n} x {k} (out x in), and FP8 matmuls "
                "need both multiples of 16; leave it out (add it to quantize.exclude) or choose a flavour "
                "whose widths are")
    if q is not None and q.float8 != "off":
        _torchao()
    return [name for name, _, _ in layers]


def _torchao():
    """torchao's float8 package, imported when a job asks for FP8 only: its import takes seconds,
    and on a machine without CUDA each of its CUDA kernels' libraries fails to load with a warning."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(f"quantize.float8 needs torchao ({e}); pip install torchao, or set "
                          "quantize.float8 = 'off'") from None
    return float8


def convert(module: nn.Module, model, q, all_gather: bool) -> None:
    """Convert the layers :func:`float8_layers` names, in place (on the meta model of adapter
    ``model``); ``all_gather``: their weights are to be all-gathered in FP8 by FSDP2 (tensorwise)."""
    float8 = _torchao()
    names = {name for name, _ in float8_layers(module, model, q)}
    config = float8.Float8LinearConfig.from_recipe_name(q.float8)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(module, config=config, module_filter_fn=lambda m, fqn: fqn in names)


def describe(parts: list[nn.Module], lay, routed_experts: bool) -> str:
    """The start-up note of an FP8 run: its recipe, how many linear layers this rank converted,
    how ZeRO-3 gathers them, and what stays in the compute dtype."""
    linear = _torchao().float8_linear.Float8Linear
    converted = sum(isinstance(m, linear) for part in parts for m in part.modules())
    line = f"FP8 ({lay.float8}) matmuls in {converted} linear layers of this rank"
    if lay.zero_stage == 3:
        line += ", all-gathered in FP8" if lay.float8_all_gather else f", all-gathered in {lay.param_dtype}"
    if routed_experts:
        line += f"; the routed experts' grouped GEMM stays in {lay.param_dtype}"
    return line


def precompute_scales(parts: list[nn.Module]) -> None:
    """After an optimizer step under FP8 all-gather: every converted weight's scale from its
    global absolute maximum, in one all-reduce for all of them (otherwise each weight's gather
    would reduce its own)."""
    float8 = _torchao()
    for part in parts:
        float8.precompute_float8_dynamic_scale_for_fsdp(part)
