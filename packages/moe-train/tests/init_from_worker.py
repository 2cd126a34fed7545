"""Spawned ranks of test_init_from.py (importable by name, so child processes can unpickle them): a run on
DP2 x EP2 that starts from train.init_from, recording its weights, fp32 masters and optimizer state just before
its first step, then training on."""

from __future__ import annotations

from pathlib import Path

import test_parallel_harness as h
from conftest import small_config


def config(run_dir: Path, data_dir: str, init_from: str | None, steps: int = 2, **train):
    cfg = small_config(run_dir.parent, steps=steps, eval_interval=0, save_interval=steps, log_interval=1,
                       init_from=init_from, device="cpu", threads=1, **train)
    cfg.train.run_dir = str(run_dir)
    cfg.data.path = data_dir
    cfg.model.router.gating = "sigmoid"  # with the expert bias: GLM-4-MoE's router, which exports
    return cfg


def before_first_step(trainer) -> dict:  # noqa: ANN001
    """What the trainer holds when its first step begins (filled in as train() runs)."""
    seen: dict = {}
    real_step = trainer._train_step

    def step() -> dict:
        if not seen:
            shards = trainer.runtime.checkpoint_shards()
            seen["shards"] = {s.global_name: (s.global_shape, s.slice, s.tensor.detach().float().clone())
                              for s in shards}
            seen["buffers"] = {n: b.detach().clone() for n, b in trainer.model.named_buffers()
                               if n.endswith("expert_bias")}
        return real_step()
    trainer._train_step = step
    return seen


def train_two_ranks(rank: int, port: int, root: str, data_dir: str, init_from: str, param_dtype: str) -> dict:
    from moe_train.trainer.loop import Trainer

    h.worker_env(rank, 2, port)
    cfg = config(Path(root) / "two", data_dir, init_from)
    cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.param_dtype = 2, 2, param_dtype
    trainer = Trainer(cfg)
    seen = before_first_step(trainer)
    summary = trainer.train()
    return {"seen": dict(seen), "summary": summary}
