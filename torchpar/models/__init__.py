"""Model families: ``[model] name`` -> the family's :class:`~torchpar.models.common.ModelAdapter`."""

from torchpar.models.common import ModelAdapter, canonical_name
from torchpar.models.gpt2 import ADAPTER as GPT2
from torchpar.models.llama import ADAPTER as LLAMA

MODELS: dict[str, ModelAdapter] = {LLAMA.name: LLAMA, GPT2.name: GPT2}
DEFAULT_FAMILY = LLAMA.name  # [model] name's default; the worked examples' flavours are this family's


def adapter(name: str) -> ModelAdapter:
    return MODELS[name]


__all__ = ["DEFAULT_FAMILY", "MODELS", "ModelAdapter", "adapter", "canonical_name"]
