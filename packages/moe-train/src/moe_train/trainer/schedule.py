"""Learning-rate schedule and AdamW parameter groups."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from moe_train.config import LR_SCHEDULES, TrainConfig


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float, schedule: str = "cosine",
          decay_fraction: float = 0.2) -> float:
    """The lr of step `step` (0-based) of `total`: linear warmup to base_lr over `warmup` steps (step 0 already
    at base_lr/warmup), then `schedule` (config.LR_SCHEDULES), each of which would reach base_lr*min_ratio at
    step `total`, one past the last:
      cosine    half a cosine from base_lr down;
      linear    a straight line down;
      constant  base_lr throughout (min_ratio unused);
      wsd       base_lr held, then a straight line down over the last decay_fraction*total steps (rounded;
                at least two, so at least one step runs below the peak); the decay never starts inside
                the warmup.
    warmup >= total: the whole run warms up and never decays (its last step at base_lr*total/warmup)."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant":
        return base_lr
    if schedule == "wsd":
        decay_start = max(warmup, total - max(2, round(decay_fraction * total)))
        progress = min(1.0, max(0, step - decay_start) / max(1, total - decay_start))
        return base_lr * (1 - (1 - min_ratio) * progress)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return base_lr * (1 - (1 - min_ratio) * progress)
    if schedule == "cosine":
        return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(f"lr schedule {schedule!r} is unknown; expected one of {LR_SCHEDULES}")


def train_lr_at(step: int, t: TrainConfig) -> float:
    """lr_at for a train config."""
    return lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio, t.lr_schedule, t.lr_decay_fraction)


SCHEDULE_FIELDS = ("lr", "warmup_steps", "steps", "min_lr_ratio")
# fields newer than checkpoints of moe-train <= 0.8: a stored train section without them ran with these
SCHEDULE_DEFAULTS = {"lr_schedule": "cosine", "lr_decay_fraction": 0.2}


def schedule_change(saved: dict[str, Any], train: TrainConfig, step: int) -> str | None:
    """A one-line warning when a run resumed at `step` jumps to another learning rate than the schedule of the
    run that wrote the checkpoint gives that step (saved: that run's stored train section), e.g. train.steps
    raised to train longer after the cosine reached its floor: it restarts from a higher point. None when both
    give this step the same lr (or the checkpoint's schedule is unknown)."""
    if not all(k in saved for k in SCHEDULE_FIELDS):
        return None
    saved = {**SCHEDULE_DEFAULTS, **saved}
    if saved["lr_schedule"] not in LR_SCHEDULES:
        return None
    then = lr_at(step, *(saved[k] for k in SCHEDULE_FIELDS), saved["lr_schedule"], saved["lr_decay_fraction"])
    now = train_lr_at(step, train)
    if math.isclose(now, then, rel_tol=1e-9):
        return None
    diffs = [f"train.{k}: {saved[k]} -> {getattr(train, k)}" for k in (*SCHEDULE_FIELDS, *SCHEDULE_DEFAULTS)
             if saved[k] != getattr(train, k)]
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
