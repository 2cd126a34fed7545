"""Spawned ranks of test_qa138_peer_failures.py (importable by name, so forkserver children can unpickle it).

One job is one run of the real Trainer on `world` gloo ranks (dp=world) of a fresh process group, with a
RuntimeError(f"boom-{rank}") injected on each rank of `fault_ranks` inside model.loss_terms at the run's second step.
`caller_group`: the rank runs dist.init_process_group itself before building the Trainer (a caller-owned group).
`agent_store`: the rendezvous store is the one the test process hosts on the job's port, as torchrun's agent hosts it
(TORCHELASTIC_USE_AGENT_STORE): every rank is its client and it outlives them all. Without it rank 0 hosts the store,
as a launch without torchrun does.
"""

from __future__ import annotations

import os
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
    agent_store: bool = True
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

    if job.agent_store:  # what torchrun sets beside MASTER_ADDR / MASTER_PORT (its agent's store)
        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    else:
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if job.caller_group:
        dist.init_process_group("gloo", rank=rank, world_size=job.world, timeout=timedelta(seconds=job.timeout_s))
    trainer = Trainer(config(job))
    if rank in job.fault_ranks:
        boom(trainer, rank, job.delays.get(rank, 0.0))
    return job.run_dir, q.train_and_record(trainer, rank)


def worker(rank: int, world: int, ports: list[int], jobs: list[Job], out_dir: str) -> None:
    q.run_jobs(rank, world, ports, jobs, out_dir, run_job)
