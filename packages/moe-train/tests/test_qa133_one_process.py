"""Many runs in one Python process (a notebook, a sweep, a test harness): a run leaves nothing behind that changes
the next run or the process. QA 133."""

from __future__ import annotations

import json
import signal

import pytest
import torch
import torch.distributed as dist

from moe_train.data import DataError
from moe_train.trainer.errors import TrainingError
from moe_train.trainer.loop import Trainer


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture
def threads_restored_at_end():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)  # whatever the code under test did, the next test gets the process's count


def test_train_threads_holds_for_its_run_only(tmp_path, data_dir, make_config, threads_restored_at_end):
    """train.threads=1 set the process's count for good: the next run of a sweep with threads=0 ("leave torch's
    default") ran on one thread."""
    before = threads_restored_at_end
    target = 1 if before != 1 else 2
    Trainer(make_config(tmp_path, threads=target, steps=2, eval_interval=0, save_interval=0)).train()
    assert torch.get_num_threads() == before


def test_train_threads_given_back_when_construction_fails(tmp_path, data_dir, make_config, threads_restored_at_end):
    before = threads_restored_at_end
    cfg = make_config(tmp_path, threads=1 if before != 1 else 2)
    cfg.data.path = str(tmp_path / "missing")
    with pytest.raises(DataError):
        Trainer(cfg)
    assert torch.get_num_threads() == before


def test_a_run_after_other_runs_and_a_failed_one_matches_the_first(tmp_path, data_dir, make_config):
    """Same config twice, with a run of other settings and a NaN-stopped world-1 DistributedRuntime between: the
    losses are bit for bit the first run's, and the failed run left no lock, signal handler or process group."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    kw = {"steps": 3, "eval_interval": 0, "save_interval": 0}
    first = make_config(tmp_path / "a", **kw)
    first.data.path = str(data_dir)
    Trainer(first).train()

    other = make_config(tmp_path, seed=7, activation_checkpointing="full", **kw)
    other.model.router.routing = "random"
    Trainer(other).train()

    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    failing = make_config(tmp_path / "a", max_skipped_steps=2, **kw)
    failing.data.path = str(data_dir)
    failing.train.run_dir = str(tmp_path / "failed")
    failing.parallel.param_dtype = "bf16"
    trainer = Trainer(failing)
    def nan_logits(module, args, out):  # the model's output, whatever its structure, times NaN
        return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")

    trainer.model.register_forward_hook(nan_logits)
    with pytest.raises(TrainingError):
        trainer.train()
    assert not dist.is_initialized()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == (sigint, sigterm)
    assert trainer.run_lock._file.closed

    again = make_config(tmp_path / "b", **kw)
    again.data.path = str(data_dir)
    Trainer(again).train()
    assert _losses(tmp_path / "b" / "run") == _losses(tmp_path / "a" / "run")


def test_a_run_leaves_a_process_group_the_caller_made_working(tmp_path, data_dir, make_config):
    """A world-1 DistributedRuntime (parallel.param_dtype=bf16) in a process whose caller had initialised the default
    group (a test harness, a notebook) destroyed that group at the run's end: the caller's next collective failed.
    Now only the groups the run made go, and the caller's world runs a second run and its own collectives."""
    from torch.distributed import distributed_c10d

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for run in ("one", "two"):
            cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=0, async_save=True)
            cfg.train.run_dir = str(tmp_path / run)
            cfg.parallel.param_dtype = "bf16"
            Trainer(cfg).train()
            assert dist.is_initialized()
            assert len(distributed_c10d._world.pg_map) == 1  # the run's dp/ep/edp/pp and async-save groups are gone
        assert _losses(tmp_path / "two") == _losses(tmp_path / "one")
        ones = torch.ones(2)
        dist.all_reduce(ones)
        assert ones.tolist() == [1.0, 1.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
