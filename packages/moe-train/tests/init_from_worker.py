"""Spawned ranks of test_init_from.py (importable by name, so child processes can unpickle them): a run on
DP2 x EP2 that starts from train.init_from, recording its weights, fp32 masters and optimizer state just before
its first step, then training on."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import test_parallel_harness as h
from test_parallel_harness import small_config


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


class GlooSums:
    """The one collective _require_one_source makes, over the real world group."""

    device = torch.device("cpu")

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t


def resolve_steps(rank: int, port: int, steps: list[int]) -> dict:
    """Each rank checks that the ranks agree on the checkpoint, this one holding step-{steps[rank]}."""
    from moe_train.trainer.init_from import _require_one_source

    h.worker_env(rank, 2, port)
    dist.init_process_group("gloo")
    try:
        _require_one_source(Path(f"/nowhere/checkpoints/step-{steps[rank]:08d}"), GlooSums())
        return {"refused": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"refused": str(e)}
