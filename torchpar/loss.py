"""The training loss, shared by the plain step and the pipeline's last stage."""

import torch
import torch.nn.functional as F


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy; works on vocab-sharded DTensor logits under loss_parallel."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum")
