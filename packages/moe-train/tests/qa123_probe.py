"""QA 123's probe of a long run: a Trainer that samples its own process at fixed step marks (before the step that
follows the mark: eval, log and save of the mark's step are done), for test_qa123_long_run.py."""

from __future__ import annotations

import gc
import os
import sys
import threading
from pathlib import Path

from moe_train.trainer.loop import Trainer


def process_sample() -> dict[str, int]:
    """Python objects the collector tracks (after a collection), memory blocks Python's allocator holds (a dict of
    floats is untracked by the collector, not by the allocator), threads, open fds, RSS, and the bytes this process
    has passed to write() and read() so far (/proc/self/io: any file, any thread)."""
    gc.collect()
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {"objects": len(gc.get_objects()), "blocks": sys.getallocatedblocks(), "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")), "rss_kib": int(status["VmRSS"].split()[0]),
            "wchar": int(io["wchar"]), "rchar": int(io["rchar"])}


class ProbedTrainer(Trainer):
    """Records process_sample() in self.samples[step] when `step` steps are done, for each step in `marks`."""

    def __init__(self, cfg, marks: tuple[int, ...], **kwargs):
        super().__init__(cfg, **kwargs)
        self.marks = set(marks)
        self.samples: dict[int, dict[str, int]] = {}

    def _train_step(self):
        if self.step in self.marks:
            self.samples[self.step] = process_sample()
        return super()._train_step()


def growth(samples: dict[int, dict[str, int]], a: int, b: int) -> dict[str, int]:
    return {k: samples[b][k] - samples[a][k] for k in samples[a]}


def two_rank_run(rank: int, port: int, root: str, steps: int, marks: tuple[int, ...]) -> dict:
    """One rank of a run on 2 gloo ranks (parallel.dp=2) into root/run: this rank's samples at `marks`."""
    import test_parallel_harness as h

    h.worker_env(rank, 2, port)
    cfg = h.small_config(Path(root), steps=steps, micro_batch_size=2, grad_accum=1, eval_interval=25, eval_windows=2,
                         log_interval=5, save_interval=25, keep_last=2, threads=1)
    cfg.parallel.dp = 2
    trainer = ProbedTrainer(cfg, marks=marks)
    trainer.train()
    return {"samples": trainer.samples}
