"""Model families: ``[model] name`` -> the family's :class:`~torchpar.models.common.ModelAdapter`."""

from torchpar.errors import ConfigError, did_you_mean
from torchpar.models.common import ModelAdapter, canonical_name
from torchpar.models.gpt2 import ADAPTER as GPT2
from torchpar.models.llama import ADAPTER as LLAMA
from torchpar.models.moe import ADAPTER as MOE

MODELS: dict[str, ModelAdapter] = {LLAMA.name: LLAMA, GPT2.name: GPT2, MOE.name: MOE}
DEFAULT_FAMILY = LLAMA.name  # [model] name's default; the worked examples' flavours are this family's


def adapter(name: str) -> ModelAdapter:
    """The family registered as ``name`` ([model] name)."""
    if name not in MODELS:
        raise ConfigError(f"model.name = {name!r} is not a registered model family."
                          f"{did_you_mean(name, MODELS)}")
    return MODELS[name]


SHAPE_FIELDS = (
    "dim",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "max_seq_len",
    "ffn_dim_multiplier",
    "multiple_of",
    "rope_theta",
    "experts",
    "top_k",
    "capacity_factor",
    "balance_coeff",
    "bias_rate",
)


def model_args(model_cfg):
    """The args of the [model] section: the family's flavour with its shape overrides (one place
    for the trainer, the planner and the checks)."""
    shape = {k: getattr(model_cfg, k) for k in SHAPE_FIELDS}
    bad = [k for k, v in {"n_layers": model_cfg.n_layers, **shape}.items() if v < 0]
    if bad:
        raise ConfigError(
            f"model.{bad[0]} must be >= 0 (0 keeps the flavour's), got {getattr(model_cfg, bad[0])}"
        )
    family = adapter(model_cfg.name)
    if model_cfg.flavor not in family.flavors:
        raise ConfigError(f"model.flavor = {model_cfg.flavor!r} is not a {family.name} "
                          f"flavour.{did_you_mean(model_cfg.flavor, family.flavors)}")
    try:
        return family.args(model_cfg.flavor, model_cfg.n_layers, **shape)
    except ValueError as e:
        raise ConfigError(str(e)) from None


__all__ = ["DEFAULT_FAMILY", "MODELS", "ModelAdapter", "adapter", "canonical_name", "model_args"]
