"""Warnings about settings that run but rarely do what the user meant (rank 0 says them once, at the start)."""

from __future__ import annotations

import warnings

import torch

from moe_train.config import Config, ParallelConfig, RouterConfig, TrainConfig


def _default(section: type, name: str) -> object:
    return section.__dataclass_fields__[name].default


def warn_about_settings(cfg: Config, device: torch.device, one_process: bool = False,
                        train_windows: int | None = None) -> None:
    """A seed the CPU generator truncates, a run that only warms up, a benchmark router, a capacity that drops
    nothing, a step that takes more windows than the train split holds (train_windows: its windows of
    data.seq_len), and a field set away from its default where this run never reads it (one_process: the run is a
    single process without a process group, LocalRuntime). `stacklevel=3` points at the Trainer's caller."""
    t, p = cfg.train, cfg.parallel
    per_step = t.micro_batch_size * t.grad_accum * p.dp
    if train_windows is not None and per_step > train_windows:
        warnings.warn(f"a step takes {per_step} windows (train.micro_batch_size={t.micro_batch_size} x "
                      f"train.grad_accum={t.grad_accum} x parallel.dp={p.dp}) and the train split holds "
                      f"{train_windows} of data.seq_len={cfg.data.seq_len}: every step trains on some windows more "
                      "than once; prepare more data, shorten data.seq_len or take fewer windows a step",
                      stacklevel=3)
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
                      "parallel.ep=1: the capacity is per EP rank (ceil(factor x the EP group's mean tokens x top_k) "
                      "of the rows it receives), and a rank that holds every expert receives exactly tokens x "
                      "top_k rows", stacklevel=3)
    unread = []
    if t.lr_schedule == "constant" and t.min_lr_ratio != _default(TrainConfig, "min_lr_ratio"):
        unread.append(f"train.min_lr_ratio={t.min_lr_ratio:g} (train.lr_schedule='constant' never decays to it)")
    r = cfg.model.router
    if cfg.model.num_experts > 0 and not r.expert_bias and r.expert_bias_rate != _default(RouterConfig,
                                                                                           "expert_bias_rate"):
        unread.append(f"model.router.expert_bias_rate={r.expert_bias_rate:g} (only model.router.expert_bias=true "
                      "moves a bias)")
    if not p.fp32_grad_accum and p.param_dtype == "fp32":
        unread.append("parallel.fp32_grad_accum=false (gradients accumulate in the weights' dtype, fp32 with "
                      "parallel.param_dtype='fp32')")
    if not p.distributed_optimizer and (p.dp == 1 or p.strategy == "fsdp"):
        why = ("parallel.dp=1: no other rank to shard the optimizer state over" if p.dp == 1
               else "parallel.strategy='fsdp' shards the optimizer state with the weights")
        unread.append(f"parallel.distributed_optimizer=false ({why})")
    if one_process and p.backend != _default(ParallelConfig, "backend"):
        unread.append(f"parallel.backend={p.backend!r} (a single process with plain fp32 weights opens no process "
                      "group)")
    if unread:
        warnings.warn(f"{'; '.join(unread)}: no effect on this run; drop them, or change what they depend on",
                      stacklevel=3)
