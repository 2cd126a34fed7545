"""The spawned ranks of test_qa76.py (importable by name, so spawned ranks can unpickle them), and the resource
probe both sides use."""

from __future__ import annotations

import gc
import os
import signal
import threading
from pathlib import Path

import torch

import test_parallel_harness as h
from test_parallel_harness import small_config


def resources() -> dict[str, int]:
    """This process now: RSS (KiB), live torch tensors and gc-tracked objects (after a collection), open file
    descriptors, Python threads and OS threads (gloo's and OpenMP's included)."""
    gc.collect()
    objects = gc.get_objects()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"rss_kib": int(status["VmRSS"].split()[0]), "tensors": sum(isinstance(o, torch.Tensor) for o in objects),
            "gc_objects": len(objects), "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "os_threads": int(status["Threads"])}


def probe_every(trainer, every: int, samples: list[dict]) -> None:  # noqa: ANN001
    """Sample resources() after every `every`-th optimizer step of `trainer`'s runtime, with no checkpoint save in
    flight (a save runs on a thread of its own while it lasts)."""
    runtime = trainer.runtime
    step = runtime.step

    def probed(lr: float):  # noqa: ANN202
        result = step(lr)
        if (trainer.step + 1) % every == 0:  # trainer.step counts the steps done before this one
            if trainer.async_saver is not None:
                trainer.async_saver.wait()
            samples.append({"step": trainer.step + 1, **resources()})
        return result

    runtime.step = probed


def ctrl_c_in_step(trainer, step: int) -> None:  # noqa: ANN001
    """Send this process SIGINT (Ctrl-C) during optimizer step `step` of `trainer`, after its update: the run stops
    with `step - 1` steps counted."""
    runtime = trainer.runtime
    inner = runtime.step

    def interrupted(lr: float):  # noqa: ANN202
        result = inner(lr)
        if trainer.step + 1 == step:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    runtime.step = interrupted


def dp2_config(run_dir: Path, data_dir: str, **train):
    cfg = small_config(run_dir.parent, device="cpu", threads=1, **train)
    cfg.train.run_dir = str(run_dir)
    cfg.data.path = data_dir
    cfg.parallel.dp = 2
    cfg.parallel.collective_timeout_s = 60.0
    cfg.train.micro_batch_size = 2
    return cfg


def long_run(rank: int, port: int, root: str, data_dir: str, steps: int, every: int) -> dict:
    """A dp=2 run of `steps` steps (async saves, evals), probed every `every` steps: {"samples": [...]}."""
    from moe_train.trainer.loop import Trainer

    h.worker_env(rank, 2, port)
    cfg = dp2_config(Path(root) / "long", data_dir, steps=steps, save_interval=4, eval_interval=5, log_interval=1,
                     async_save=True, keep_last=2)
    samples: list[dict] = []
    trainer = Trainer(cfg)
    probe_every(trainer, every, samples)
    trainer.train()
    return {"samples": samples}


def straight_and_split(rank: int, ports: list[int], root: str, data_dir: str, n: int, probe: int) -> dict:
    """dp=2: `2n` steps straight, twice (the first probed every `probe` steps), and `2n` steps stopped by Ctrl-C
    during step n+3 (a checkpoint at n), then resumed by a new Trainer: {"samples": [...], "stopped": str, "after":
    [...]}."""
    from moe_train.trainer.loop import Trainer

    root = Path(root)
    samples: list[dict] = []
    after: list[dict] = []  # resources() after each Trainer, its process groups released
    stopped = ""
    for port, name in zip(ports, ("straight", "again", "split", "split")):
        h.worker_env(rank, 2, port)
        trainer = Trainer(dp2_config(root / name, data_dir, steps=2 * n, save_interval=n, eval_interval=3,
                                     log_interval=1, async_save=True, keep_last=2))
        if name == "straight":
            probe_every(trainer, probe, samples)
        if name == "split" and not stopped:
            ctrl_c_in_step(trainer, n + 3)
        try:
            trainer.train()
        except KeyboardInterrupt as e:
            stopped = str(e)
        del trainer
        h.release_process_groups()
        after.append(resources())
    return {"samples": samples, "stopped": stopped, "after": after}
