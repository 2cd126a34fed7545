"""Spawned ranks of test_qa138_peer_failures.py (importable by name, so forkserver children can unpickle it).

One job is one run of the real Trainer on `world` gloo ranks (dp=world) of a fresh process group, with a
RuntimeError(f"boom-{rank}") injected on each rank of `fault_ranks` inside model.loss at the run's second step.
`caller_group`: the rank runs dist.init_process_group itself before building the Trainer (a caller-owned group).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

import qa135_worker as q
import test_parallel_harness as h


@dataclass
class Job:
    run_dir: str
    data_dir: str
    world: int
    fault_ranks: tuple = (1,)
    timeout_s: float = 8.0
    caller_group: bool = False
    delays: dict = field(default_factory=dict)  # rank -> seconds it waits inside model.loss before raising
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


def run_job(rank: int, job: Job) -> dict:
    from moe_train.trainer.loop import Trainer

    if job.caller_group:
        dist.init_process_group("gloo", rank=rank, world_size=job.world, timeout=timedelta(seconds=job.timeout_s))
    trainer = Trainer(config(job))
    if rank in job.fault_ranks:
        boom(trainer, rank, job.delays.get(rank, 0.0))
    out: dict = {"rank": rank}
    try:
        out["summary"] = trainer.train()
        out["error"] = None
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the result
        out["error"] = type(e).__name__
        out["message"] = str(e)
        out["trace"] = "".join(traceback.format_exception(e))
    out["ended_at"] = time.time()
    out["fault_at"] = getattr(trainer, "fault_at", None)
    return out


def worker(rank: int, world: int, ports: list[int], jobs: list[Job], out_dir: str) -> None:
    def body(_rank: int) -> dict:
        out = {}
        for port, job in zip(ports, jobs):
            h.worker_env(rank, world, port)
            out[job.run_dir] = run_job(rank, job)
            h.release_process_groups()
        return out
    h.run_guarded(rank, body, out_dir)
