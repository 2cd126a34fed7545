"""Spawned ranks of test_qa137_review.py (importable by name, so forkserver children can unpickle it)."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

import qa135_worker as q
import test_parallel_harness as h


def run_job(rank: int, job: q.Job, local_first: bool) -> dict:
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
    out: dict = {"rank": rank}
    try:
        out["summary"] = trainer.train()
        out["error"] = None
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the result
        out["error"] = type(e).__name__
        out["message"] = str(e)
        out["trace"] = "".join(traceback.format_exception(e))
    return out


def worker(rank: int, world: int, ports: list[int], jobs: list[tuple[q.Job, bool]], out_dir: str) -> None:
    def body(_rank: int) -> dict:
        out = {}
        for port, (job, local_first) in zip(ports, jobs):
            h.worker_env(rank, world, port)
            out[job.run_dir] = run_job(rank, job, local_first)
            h.release_process_groups()
        return out
    h.run_guarded(rank, body, out_dir)
