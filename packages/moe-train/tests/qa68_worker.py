"""The spawned ranks of test_qa68.py (importable by name, so spawned ranks can unpickle them)."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import test_parallel_harness as h
from test_parallel_harness import small_config


def _dp2_config(run_dir: Path, data_dir: str, **train):
    cfg = small_config(run_dir.parent, device="cpu", threads=1, **train)
    cfg.train.run_dir = str(run_dir)
    cfg.data.path = data_dir
    cfg.parallel.dp = 2
    cfg.parallel.collective_timeout_s = 30.0  # a rank left waiting fails in 30 s, not 30 minutes
    cfg.train.micro_batch_size = 2
    return cfg


def _train(cfg) -> dict:  # noqa: ANN001
    """Build and train; the error this rank stopped with, and how long it took."""
    from moe_train.trainer.loop import Trainer

    started = time.perf_counter()
    try:
        Trainer(cfg).train()
    except Exception as e:  # noqa: BLE001 - the parent checks which
        return {"type": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - started}
    return {"type": None, "message": "", "seconds": time.perf_counter() - started}


def start_dp2(rank: int, ports: list[int], root: str, data_dir: str) -> dict:
    """Starts that rank 0 alone, or rank 1 alone, judges differently: {scenario: this rank's outcome}.

    data_missing_on_rank1: data.path is not on rank 1's host (a local copy per host, one not made).
    run_dir_under_a_file: train.run_dir's parent is a file, so rank 0's lock (the run folder is rank 0's) fails
    with NotADirectoryError. stale_view: the run folder as rank 1's host sees it lacks the newest checkpoint
    (another host's file system cache), so rank 1 would resume from an older one than rank 0."""
    out = {}
    root = Path(root)
    h.worker_env(rank, 2, ports[2])
    data = data_dir if rank == 0 else str(root / "not_copied_to_this_host")
    out["data_missing_on_rank1"] = _train(_dp2_config(root / "fresh", data, steps=2, eval_interval=0))
    h.release_process_groups()
    h.worker_env(rank, 2, ports[0])
    out["run_dir_under_a_file"] = _train(_dp2_config(root / "a_file" / "run", data_dir, steps=2, eval_interval=0))
    h.release_process_groups()
    h.worker_env(rank, 2, ports[1])
    run_dir = root / ("run" if rank == 0 else "stale")
    out["stale_view"] = _train(_dp2_config(run_dir, data_dir, steps=6, eval_interval=0, save_interval=2))
    return out


def metrics_write_fails_on_rank0(rank: int, port: int, root: str, data_dir: str) -> dict:
    """Rank 0's metrics.jsonl write of step 2's record fails with ENOSPC (the other ranks write nothing)."""
    from moe_train.trainer.metrics import MetricsLog

    h.worker_env(rank, 2, port)
    write = MetricsLog.write

    def full_disk(self, record):  # noqa: ANN001
        if self.enabled and record.get("step") == 2 and "event" not in record:  # rank 0 writes, the others skip
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        write(self, record)

    MetricsLog.write = full_disk
    try:
        return _train(_dp2_config(Path(root) / "run", data_dir, steps=4, log_interval=1, eval_interval=0,
                                  save_interval=0))
    finally:
        MetricsLog.write = write
