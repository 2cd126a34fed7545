"""Spawned ranks of test_qa135_rank_failures.py (importable by name, so forkserver children can unpickle it).

Each job is one run of the real Trainer on 2 gloo ranks of a fresh process group, with one failure injected on one
rank only (FAULTS below). Every rank returns what it raised, when (time.time(), the same clock on both ranks of one
machine), and when its fault fired, so the test can say how long the other rank took to stop.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

import test_parallel_harness as h
from test_parallel_harness import small_config

FAULT_STEP = 1  # trainer.step (steps done) when the fault fires: during the run's second step
TIMEOUT_S = 20.0  # parallel.collective_timeout_s: a rank that waits for a dead peer this long shows up as a hang


@dataclass
class Job:
    name: str  # the fault: a key of FAULTS
    run_dir: str
    data_dir: str
    fault_rank: int = 1
    train: dict = field(default_factory=dict)
    timeout_s: float = TIMEOUT_S  # parallel.collective_timeout_s


def config(job: Job):  # noqa: ANN201
    t = {"steps": 4, "eval_interval": 0, "log_interval": 1, "save_interval": 1, "device": "cpu", "threads": 1,
         "micro_batch_size": 2, **job.train}
    cfg = small_config(Path(job.run_dir).parent, **t)
    cfg.train.run_dir = job.run_dir
    cfg.data.path = job.data_dir
    cfg.parallel.dp = 2
    cfg.parallel.collective_timeout_s = job.timeout_s
    return cfg


# ---- faults: each patches one rank's trainer (called on the fault rank only) -------------------------------------
def _at_fault_step(trainer, action) -> None:  # noqa: ANN001
    """Run action() inside model.loss_terms of the training micro-batch at FAULT_STEP."""
    real = trainer.model.loss_terms

    def loss_terms(x, y):  # noqa: ANN001, ANN202
        if trainer.model.training and trainer.step == FAULT_STEP and getattr(trainer, "fault_at", None) is None:
            trainer.fault_at = time.time()  # once: the step's first micro-batch
            action(x, y)
        return real(x, y)
    trainer.model.loss_terms = loss_terms


def raise_in_step(trainer) -> None:  # noqa: ANN001
    def boom(x, y):  # noqa: ANN001, ANN202
        raise RuntimeError("qa135: injected failure on this rank")
    _at_fault_step(trainer, boom)


def sigint(trainer) -> None:  # noqa: ANN001
    _at_fault_step(trainer, lambda x, y: os.kill(os.getpid(), signal.SIGINT))


def bad_tokens(trainer) -> None:  # noqa: ANN001
    """A batch holding a token id past the vocabulary (a corrupt read on this rank's host, say)."""
    real_next = trainer.sampler.next_batch

    def next_batch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        x, y = real_next(*args, **kwargs)
        if trainer.step == FAULT_STEP:
            trainer.fault_at = time.time()
            x = x.clone()
            x[0, 0] = trainer.cfg.model.vocab_size + 7
        return x, y
    trainer.sampler.next_batch = next_batch


def nan_loss(trainer) -> None:  # noqa: ANN001
    """NaN loss on this rank from FAULT_STEP on (finite gradients: only the loss says so)."""
    real = trainer.model.loss_terms

    def loss_terms(x, y):  # noqa: ANN001, ANN202
        terms = real(x, y)
        if trainer.model.training and trainer.step >= FAULT_STEP:
            trainer.fault_at = getattr(trainer, "fault_at", None) or time.time()
            terms = terms._replace(ce=terms.ce + torch.tensor(float("nan")))
        return terms
    trainer.model.loss_terms = loss_terms


def save_fails(trainer) -> None:  # noqa: ANN001
    """Writing this rank's shard of the step-(FAULT_STEP + 1) checkpoint raises PermissionError."""
    import moe_ckpt.save as save_mod

    real = save_mod.write_shard_file

    def write(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if f"step-{FAULT_STEP + 1:08d}.tmp" in str(path):  # by name: an async save writes while the next step runs
            trainer.fault_at = time.time()
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)
    save_mod.write_shard_file = write


def raise_in_backward(trainer) -> None:  # noqa: ANN001
    """An error raised half-way through backward (a gradient hook on block 1's output), after the later blocks'
    gradient buckets may have started their all-reduce."""
    block = trainer.model.blocks[1]

    def hook(module, args, out):  # noqa: ANN001, ANN202
        if trainer.model.training and trainer.step == FAULT_STEP and torch.is_grad_enabled():
            tensor = out[0] if isinstance(out, tuple) else out

            def fail(grad):  # noqa: ANN001, ANN202
                trainer.fault_at = time.time()
                raise RuntimeError("qa135: injected failure in backward on this rank")
            tensor.register_hook(fail)
    block.register_forward_hook(hook)


def stall(trainer) -> None:  # noqa: ANN001
    """This rank stops answering (a hung file read, say) for twice the collective timeout, then goes on."""
    _at_fault_step(trainer, lambda x, y: time.sleep(2 * trainer.cfg.parallel.collective_timeout_s))


FAULTS = {"raise": raise_in_step, "sigint": sigint, "tokens": bad_tokens, "nan": nan_loss, "save": save_fails,
          "backward": raise_in_backward, "stall": stall}


def train_and_record(trainer, rank: int) -> dict:  # noqa: ANN001
    """trainer.train() on this rank: its summary or what it raised, when it ended and when its fault fired."""
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


def run_jobs(rank: int, world: int, ports: list[int], jobs: list, out_dir: str, run_one) -> None:  # noqa: ANN001
    """run_one(rank, job) -> (key, result) for each job in turn, each in a process group of its own; every result
    saved under its key (qa137_worker and qa138_worker run their own jobs through this)."""
    def body(_rank: int) -> dict:
        out = {}
        for port, job in zip(ports, jobs):
            h.worker_env(rank, world, port)
            key, result = run_one(rank, job)
            out[key] = result
            h.release_process_groups()
        return out
    h.run_guarded(rank, body, out_dir)


def run_job(rank: int, job: Job) -> tuple[str, dict]:
    from moe_train.trainer.loop import Trainer

    trainer = Trainer(config(job))
    if rank == job.fault_rank:
        FAULTS[job.name](trainer)
    return job.run_dir, train_and_record(trainer, rank)


def worker(rank: int, world: int, ports: list[int], jobs: list[Job], out_dir: str) -> None:
    run_jobs(rank, world, ports, jobs, out_dir, run_job)
