"""Model registry: the family name in ``[model] name`` -> its module's pieces."""

from torchpar.models.llama import FLAVORS, ModelArgs, Transformer, flops_per_token, model_args, num_params, param_counts

MODELS = {"llama3": Transformer}

__all__ = ["FLAVORS", "MODELS", "ModelArgs", "Transformer", "flops_per_token", "model_args", "num_params", "param_counts"]
