"""Spawned workers of test_layout_resume.py (importable by name, so child processes can unpickle them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.multiprocessing as mp

import test_parallel_harness as h
from moe_train.config import Config


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
    out_dir.mkdir(parents=True, exist_ok=True)
    ports = [h.free_port() for _ in jobs]
    mp.spawn(worker, args=(world, ports, jobs, str(out_dir)), nprocs=world, join=True)
    h.load_results(out_dir, world)
