"""Spawned ranks of test_qa137_review.py (importable by name, so forkserver children can unpickle it)."""

from __future__ import annotations

from pathlib import Path

import torch

import qa135_worker as q


def run_job(rank: int, item: tuple[q.Job, bool]) -> tuple[str, dict]:
    job, local_first = item
    from moe_train.trainer.loop import Trainer
    from moe_train.trainer.runtime import LocalRuntime

    if local_first and rank == 0:
        # rank 0 alone evaluates something with a one-process Trainer first (its own run folder), and closes it
        cfg = q.config(job)
        cfg.parallel.dp = 1
        cfg.train.run_dir = str(Path(job.run_dir).parent / "local_run")
        Trainer(cfg, runtime=LocalRuntime(cfg, torch.device("cpu"))).close()
    trainer = Trainer(q.config(job))
    if rank == job.fault_rank:
        q.FAULTS[job.name](trainer)
    return job.run_dir, q.train_and_record(trainer, rank)


def worker(rank: int, world: int, ports: list[int], jobs: list[tuple[q.Job, bool]], out_dir: str) -> None:
    q.run_jobs(rank, world, ports, jobs, out_dir, run_job)
