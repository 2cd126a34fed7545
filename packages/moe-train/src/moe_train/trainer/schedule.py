"""Learning-rate schedule and AdamW parameter groups."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from moe_train.config import TrainConfig


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """The lr of step `step` (0-based) of `total`: linear warmup to base_lr over `warmup` steps (step 0 already
    at base_lr/warmup), then cosine decay that would reach base_lr*min_ratio at step `total`, one past the last.
    warmup >= total: the whole run warms up and never decays (its last step at base_lr*total/warmup)."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


SCHEDULE_FIELDS = ("lr", "warmup_steps", "steps", "min_lr_ratio")


def schedule_change(saved: dict[str, Any], train: TrainConfig, step: int) -> str | None:
    """A one-line warning when a run resumed at `step` jumps to another learning rate than the schedule of the
    run that wrote the checkpoint gives that step (saved: that run's stored train section), e.g. train.steps
    raised to train longer after the cosine reached its floor: it restarts from a higher point. None when both
    give this step the same lr (or the checkpoint's schedule is unknown)."""
    if not all(k in saved for k in SCHEDULE_FIELDS):
        return None
    then = lr_at(step, saved["lr"], saved["warmup_steps"], saved["steps"], saved["min_lr_ratio"])
    now = lr_at(step, train.lr, train.warmup_steps, train.steps, train.min_lr_ratio)
    if math.isclose(now, then, rel_tol=1e-9):
        return None
    diffs = [f"train.{k}: {saved[k]} -> {getattr(train, k)}" for k in SCHEDULE_FIELDS if saved[k] != getattr(train, k)]
    return (f"the learning-rate schedule differs from the checkpoint's run ({'; '.join(diffs)}): step {step + 1} "
            f"runs at lr={now:.4g}, where the schedule of the run that wrote the checkpoint gives {then:.4g}")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never decay norms, biases or other vectors."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
