"""Spawned ranks of test_qa138_peer_failures.py (importable by name, so forkserver children can unpickle it).

One job is one run of the real Trainer on `world` gloo ranks (dp=world) of a fresh process group, with a
RuntimeError(f"boom-{rank}") injected on each rank of `fault_ranks` inside model.loss_terms at the run's second step.
`caller_group`: the rank runs dist.init_process_group itself before building the Trainer (a caller-owned group).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

import qa135_worker as q


@dataclass
class Job:
    run_dir: str
    data_dir: str
    world: int
    fault_ranks: tuple = (1,)
    timeout_s: float = 8.0
    caller_group: bool = False
    delays: dict = field(default_factory=dict)  # rank -> seconds it waits inside model.loss_terms before raising
    train: dict = field(default_factory=dict)


def config(job: Job):  # noqa: ANN201
    cfg = q.config(q.Job("raise", job.run_dir, job.data_dir, train=job.train, timeout_s=job.timeout_s))
    cfg.parallel.dp = job.world
    return cfg


def boom(trainer, rank: int, delay: float) -> None:  # noqa: ANN001
    def fail(x, y):  # noqa: ANN001, ANN202
        time.sleep(delay)  # still before this rank's next collective: its own error, not a peer's consequence
        raise RuntimeError(f"boom-{rank}")
    q._at_fault_step(trainer, fail)


def run_job(rank: int, job: Job) -> tuple[str, dict]:
    from moe_train.trainer.loop import Trainer

    if job.caller_group:
        dist.init_process_group("gloo", rank=rank, world_size=job.world, timeout=timedelta(seconds=job.timeout_s))
    trainer = Trainer(config(job))
    if rank in job.fault_ranks:
        boom(trainer, rank, job.delays.get(rank, 0.0))
    return job.run_dir, q.train_and_record(trainer, rank)


def worker(rank: int, world: int, ports: list[int], jobs: list[Job], out_dir: str) -> None:
    q.run_jobs(rank, world, ports, jobs, out_dir, run_job)
