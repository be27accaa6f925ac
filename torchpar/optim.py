"""Optimizer and learning-rate schedule, each built from its own config section."""

from __future__ import annotations

import math

import torch


def build_optimizer(params, cfg, device_type: str) -> torch.optim.Optimizer:
    """AdamW over ``params``; ``cfg`` is the [optimizer] section."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused"  # torch has it for CUDA and CPU alike
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
        fused=impl == "fused", foreach=impl == "foreach",
    )


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's lazily made state now (a checkpoint is loaded into it before any step):
    one step with zero gradients and lr 0, which leaves the parameters exactly as they are."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None


def lr_factor(step: int, cfg, total_steps: int) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based); ``cfg`` is [lr_scheduler].

    Linear warmup from 1/(warmup+1) to 1, then linear or cosine decay to ``min_lr_ratio``.
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.decay_type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    decay = 1.0 - progress if cfg.decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose restore also puts the restored lr into the optimizer (LambdaLR's own
    ``load_state_dict`` leaves the optimizer at its initial lr until the next step)."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self.get_last_lr()):
            group["lr"] = lr


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> LRSchedule:
    return LRSchedule(optimizer, lambda step: lr_factor(step, cfg, total_steps))
