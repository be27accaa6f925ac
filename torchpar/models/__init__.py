"""Model families: ``[model] name`` -> the family's :class:`~torchpar.models.common.ModelAdapter`."""

import dataclasses
import importlib

from torchpar.errors import ConfigError, did_you_mean
from torchpar.models.common import ModelAdapter, canonical_name
from torchpar.models.deepseek import ADAPTER as DEEPSEEK_V3
from torchpar.models.gpt2 import ADAPTER as GPT2
from torchpar.models.gpt_oss import ADAPTER as GPT_OSS
from torchpar.models.llama import ADAPTER as LLAMA
from torchpar.models.moe import ADAPTER as MOE
from torchpar.models.qwen3 import ADAPTER as QWEN3

MODELS: dict[str, ModelAdapter] = {family.name: family for family in (LLAMA, GPT2, QWEN3, MOE, DEEPSEEK_V3,
                                                                     GPT_OSS)}
DEFAULT_FAMILY = LLAMA.name  # [model] name's default; the worked examples' flavours are this family's


def adapter(name: str) -> ModelAdapter:
    """The family registered as ``name`` ([model] name), or the adapter a ``module:NAME`` path
    names (a family kept outside the package, e.g. a fork's experiment: importing its module runs
    its code, as a Python config would)."""
    if name in MODELS:
        return MODELS[name]
    if ":" not in name:
        raise ConfigError(f"model.name = {name!r} is not a registered model family, nor a module:NAME "
                          f"path to an adapter.{did_you_mean(name, MODELS)}")
    module, _, attr = name.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model.name = {name!r}: {type(e).__name__}: {e}; give module:NAME of a model "
                          "adapter on the import path (PYTHONPATH)") from None
    if not isinstance(found, ModelAdapter):
        raise ConfigError(f"model.name = {name!r} names a {type(found).__name__}, not a ModelAdapter "
                          "instance")
    return found


# [model]'s fields that are not the model's shape; every other one overrides the flavour's field of
# the same name (0, or unset for a yes/no field, keeps the flavour's), so a field added to [model]
# and to the family's args dataclass needs nothing else.
NOT_SHAPE = ("name", "flavor", "tokenizer_path")


def model_args(model_cfg):
    """The args of the [model] section: the family's flavour with its shape overrides (one place
    for the trainer, the planner and the checks)."""
    shape = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)
             if f.name not in NOT_SHAPE}
    bad = [k for k, v in shape.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0]
    if bad:
        raise ConfigError(
            f"model.{bad[0]} must be >= 0 (0 keeps the flavour's), got {getattr(model_cfg, bad[0])}"
        )
    family = adapter(model_cfg.name)
    if model_cfg.flavor not in family.flavors:
        raise ConfigError(f"model.flavor = {model_cfg.flavor!r} is not a {family.name} "
                          f"flavour.{did_you_mean(model_cfg.flavor, family.flavors)}")
    try:
        return family.args(model_cfg.flavor, **shape)
    except ValueError as e:
        raise ConfigError(str(e)) from None


__all__ = ["DEFAULT_FAMILY", "MODELS", "ModelAdapter", "adapter", "canonical_name", "model_args"]
