"""Model families: ``[model] name`` -> the family's :class:`~torchpar.models.common.ModelAdapter`."""

from torchpar.models.common import ModelAdapter, canonical_name
from torchpar.models.gpt2 import ADAPTER as GPT2
from torchpar.models.llama import ADAPTER as LLAMA

MODELS: dict[str, ModelAdapter] = {LLAMA.name: LLAMA, GPT2.name: GPT2}


def adapter(name: str) -> ModelAdapter:
    return MODELS[name]


__all__ = ["MODELS", "ModelAdapter", "adapter", "canonical_name"]
