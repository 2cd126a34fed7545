"""Spawned workers of test_layout_resume.py (importable by name, so child processes can unpickle them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import test_parallel_harness as h
from moe_train.config import Config, DataConfig, ModelConfig, TrainConfig


def run_config(model: ModelConfig, data: Path, run_dir: Path, steps: int, dp: int = 1, ep: int = 1) -> Config:
    """The resume tests' recipe on CPU: 8 sequences of 16 tokens a step over dp ranks, 2 micro-batches, fp32,
    a checkpoint every 3 steps, a metrics record every step."""
    cfg = Config(
        model=model,
        data=DataConfig(path=str(data), seq_len=16),
        train=TrainConfig(steps=steps, micro_batch_size=8 // dp, grad_accum=2, warmup_steps=2, eval_interval=0,
                          log_interval=1, save_interval=3, run_dir=str(run_dir), progress=False, device="cpu",
                          threads=1),
        preset="test",
    )
    cfg.parallel.dp, cfg.parallel.ep = dp, ep
    return cfg


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of a run's metrics.jsonl (the records that have a loss)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def seed_run_dir(src: Path, dst: Path, step: int = 3) -> None:
    """A new run folder holding only src's checkpoint at `step` (as if the job moved there)."""
    name = f"step-{step:08d}"
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)


def run_trainer(cfg: Config) -> None:
    from moe_train.trainer.loop import Trainer

    Trainer(cfg).train()


def worker(rank: int, world: int, ports: list[int], jobs: list[tuple], out_dir: str) -> None:
    """Run each job (a Config) in turn as one rank of a fresh process group."""
    def body() -> dict:
        for port, (cfg, before) in zip(ports, jobs):
            if before is not None and rank == 0:
                seed_run_dir(*before)
            h.worker_env(rank, world, port)
            torch.distributed.barrier() if torch.distributed.is_initialized() else None
            run_trainer(cfg)
        return {}
    h.run_guarded(rank, lambda _rank: body(), out_dir)


def spawn(world: int, jobs: list[tuple], out_dir: Path) -> None:
    h.spawn_jobs(worker, world, jobs, out_dir)
