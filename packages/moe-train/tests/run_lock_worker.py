"""Spawned worker of test_run_lock.py (importable by name, so child processes can unpickle it)."""

from __future__ import annotations

import time

import test_parallel_harness as h
from moe_train.trainer.loop import Trainer
from moe_train.trainer.run_lock import RunFolderBusyError


def construct_trainer(rank: int, port: int, run_dir: str, data_dir: str) -> dict:
    """Build a 2-rank Trainer into run_dir on data_dir (vocab 512); what it raised, and how long that took."""
    h.worker_env(rank, 2, port)
    cfg = h.shrunk_tiny(2, 1)
    cfg.model.vocab_size, cfg.data.path, cfg.train.run_dir = 512, data_dir, run_dir
    start = time.monotonic()
    try:
        Trainer(cfg)
    except RunFolderBusyError as e:
        return {"error_type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error_type": None}
