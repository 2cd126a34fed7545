"""Learning-rate schedule and AdamW parameter groups."""

from __future__ import annotations

import math

from torch import nn


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to base_lr over `warmup` steps, then cosine decay to base_lr*min_ratio at `total`."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never decay norms, biases or other vectors."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
