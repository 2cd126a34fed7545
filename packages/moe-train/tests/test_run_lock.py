"""One job per run folder: a second job into a folder a live job is training in is refused before
it touches anything, on every rank; the lock goes with the job that held it, however it ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_train.trainer.loop import Trainer
from moe_train.trainer.run_lock import LOCK_NAME, RunFolderBusyError, RunFolderLock

sys.path.insert(0, str(Path(__file__).parent))
import run_lock_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402

HOLD = """
import sys, time
from moe_train.trainer.run_lock import RunFolderLock
lock = RunFolderLock(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def _hold_in_another_process(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_trainer_into_a_busy_run_folder_is_refused_naming_the_job(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    first = Trainer(cfg)
    with pytest.raises(RunFolderBusyError, match=rf"run_dir='.*/run' is in use by another job \(host .*, pid {os.getpid()},"):
        Trainer(cfg)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    first.train()  # the refused one took nothing away from the first
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert before == [LOCK_NAME]
    cfg.train.steps = 3
    assert Trainer(cfg).train()["step"] == 3  # released when the first run ended


def test_a_killed_job_leaves_no_stale_lock(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    proc = _hold_in_another_process(tmp_path / "run")
    try:
        with pytest.raises(RunFolderBusyError, match=rf"pid {proc.pid},"):
            Trainer(cfg)
    finally:
        proc.kill()
        proc.wait()
    assert Trainer(cfg).train()["step"] == 1


def test_a_failed_construction_releases_the_lock(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=0)
    cfg.data.path = str(tmp_path / "no-such-data")
    with pytest.raises(Exception, match="no-such-data") as failed:
        Trainer(cfg)
    # the traceback keeps the half-built Trainer (and any file it holds) alive: the lock must be dropped anyway
    assert failed.traceback is not None
    RunFolderLock(tmp_path / "run").release()


def test_a_refused_run_removes_the_run_folder_it_made_and_keeps_one_that_was_there(tmp_path, data_dir, make_config):
    """A run refused before it wrote anything (train.init_from names nothing) left a new run folder holding only
    .lock; the folder is removed now. A folder that existed before the run is kept as it was."""
    for existed in (False, True):
        cfg = make_config(tmp_path / str(existed), steps=1, eval_interval=0, save_interval=0,
                          init_from=str(tmp_path / "missing"))
        cfg.data.path = str(data_dir)
        run = Path(cfg.train.run_dir)
        if existed:
            run.mkdir(parents=True)
        with pytest.raises(Exception, match="does not exist"):
            Trainer(cfg).train()
        assert run.exists() == existed, existed
    # a lock a later job takes in the same place works as before
    RunFolderLock(tmp_path / "False" / "run").release()


def test_every_rank_of_a_job_into_a_busy_folder_raises(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    proc = _hold_in_another_process(run_dir)
    try:
        out = tmp_path / "out"
        out.mkdir()
        h.start_ranks(h.run_guarded, args=(w.construct_trainer, str(out), h.free_port(), str(run_dir), str(data_dir)), nprocs=2)
        results = h.load_results(out, 2)
    finally:
        proc.kill()
        proc.wait()
    assert [r["error_type"] for r in results] == ["RunFolderBusyError", "RunFolderBusyError"]
    assert f"pid {proc.pid}," in results[0]["message"]
    assert "rank 0 could not lock it" in results[1]["message"]
    assert all(r["seconds"] < 60 for r in results), [r["seconds"] for r in results]
