"""Warnings about settings that run but rarely do what the user meant (rank 0 says them once, at the start)."""

from __future__ import annotations

import warnings

import torch

from moe_train.config import Config


def warn_about_settings(cfg: Config, device: torch.device) -> None:
    """A seed the CPU generator truncates, a run that only warms up, a benchmark router, a capacity that drops
    nothing. `stacklevel=3` points at the Trainer's caller."""
    t, p = cfg.train, cfg.parallel
    if device.type == "cpu" and t.seed >= 2**32:
        warnings.warn(f"train.seed={t.seed}: torch's CPU generator keeps the low 32 bits of a seed, so on "
                      f"the CPU this run initialises as train.seed={t.seed % 2**32} does", stacklevel=3)
    if t.warmup_steps > t.steps:
        warnings.warn(f"train.warmup_steps={t.warmup_steps} > train.steps={t.steps}: the whole run warms up, "
                      f"its lr peaks at lr x {t.steps}/{t.warmup_steps} = {t.lr * t.steps / t.warmup_steps:.3g} "
                      f"(train.lr={t.lr:g}) and never decays", stacklevel=3)
    routing = cfg.model.router.routing
    if routing != "learned" and cfg.model.num_experts > 0:  # the bench presets' default
        from moe_train.presets import PRESETS

        preset = cfg.preset in PRESETS and PRESETS[cfg.preset]().model.router.routing == routing
        sets = f" (preset {cfg.preset} sets it)" if preset else ""
        warnings.warn(f"model.router.routing={routing!r}{sets} is a benchmark mode: the router never chooses "
                      "the experts, so this run does not train a model to use (export-hf refuses it); set "
                      "--model.router.routing=learned to train the router", stacklevel=3)
    if p.expert_capacity_factor > 0 and p.ep == 1:
        warnings.warn(f"parallel.expert_capacity_factor={p.expert_capacity_factor:g} drops nothing with "
                      "parallel.ep=1: the capacity is per EP rank (ceil(factor x the rank's tokens x top_k) of "
                      "the rows it receives), and a rank that holds every expert receives exactly tokens x "
                      "top_k rows", stacklevel=3)
