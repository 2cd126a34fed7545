"""A run folder across attempts: metrics.jsonl after a crash before the first checkpoint or mid-line, a
symlinked metrics.jsonl, a resume that fails (end event, runtime closed), and a resume that changes the
eval set (a checkpoint of moe-train 0.3.0, which stored train.eval_batches)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist

from moe_ckpt import ChecksumMismatchError, step_dir
from moe_train.trainer.errors import TrainingError
from moe_train.trainer.launch import make_runtime
from moe_train.trainer.loop import Trainer
from moe_train.trainer.metrics import MetricsLog
from moe_train.trainer.runtime import LocalRuntime
from metadata_edit import rewrite_metadata  # noqa: E402
import test_parallel_harness


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    return prepare_data(list(stdlib_documents(100_000)), tmp_path_factory.mktemp("data") / "data", vocab_size=512,
                        source="stdlib-test")


@pytest.fixture
def config(tmp_path, data, make_config):
    def build(**train):
        cfg = make_config(tmp_path, **{"steps": 2, "save_interval": 2, "eval_interval": 2, "log_interval": 1,
                                       "grad_accum": 1, **train})
        cfg.data.path = str(data)
        return cfg
    return build


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # every line must be JSON


def corrupt_shard(run) -> None:
    shard = step_dir(run / "checkpoints", 2) / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))


def test_a_rerun_after_a_crash_before_the_first_checkpoint_keeps_one_record_per_step(tmp_path, config):
    """The crashed attempt logged its step-0 eval and step 1, then died mid-line: the rerun from step 0
    replaces those records (the events stay) and appends nothing to the cut line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "start", "resumed_from_step": null}\n'
                                       '{"step": 0, "eval_loss": 6.2}\n{"loss": 6.2, "step": 1}\n{"loss": 6.1, "st')
    Trainer(config()).train()
    records = read_lines(run / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 2]
    assert [r["event"] for r in records if "event" in r] == ["start", "start", "end"]


def test_a_write_after_a_line_cut_short_drops_the_cut_record(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.path.write_text('{"step": 1, "loss": 6.2}\n{"step": 2, "lo')
    log.write({"event": "start"})
    assert read_lines(log.path) == [{"step": 1, "loss": 6.2}, {"event": "start"}]
    log.path.write_text('{"step": 1, "lo')  # no complete line at all
    log.write({"event": "end"})
    assert read_lines(log.path) == [{"event": "end"}]


def test_rewinding_a_symlinked_metrics_log_rewrites_its_target_and_keeps_the_link(tmp_path):
    target = tmp_path / "synced" / "metrics.jsonl"
    target.parent.mkdir()
    target.write_text('{"event": "start"}\n{"step": 1, "loss": 6.2}\n{"step": 2, "loss": 6.1}\n')
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to(target)
    log = MetricsLog(tmp_path / "run" / "metrics.jsonl")
    assert log.rewind(1) == 1
    assert log.path.is_symlink() and log.path.resolve() == target
    assert read_lines(target) == [{"event": "start"}, {"step": 1, "loss": 6.2}]
    assert not list(target.parent.glob(".*.tmp")) and not list(log.path.parent.glob(".*.tmp"))


@pytest.fixture
def gloo_port(monkeypatch):
    port = test_parallel_harness.free_port()  # not a port-0 pick another process could take meanwhile
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield port
    if dist.is_initialized():  # the test failed: leave no process group to later tests
        dist.destroy_process_group()


def test_a_failed_resume_writes_an_end_event_and_destroys_the_process_group(tmp_path, config, gloo_port):
    cfg = config()
    Trainer(cfg).train()
    corrupt_shard(tmp_path / "run")
    cfg.train.steps = 4
    cfg.parallel.expert_capacity_factor = 2.0  # a world of one on the distributed runtime: a real gloo group
    trainer = Trainer(cfg, make_runtime(cfg, torch.device("cpu")))
    assert dist.is_initialized()
    with pytest.raises(ChecksumMismatchError):
        trainer.train()
    assert not dist.is_initialized()
    start, end = read_lines(tmp_path / "run" / "metrics.jsonl")[-2:]
    assert start["event"] == "start" and start["resumed_from_step"] == 2
    assert end["event"] == "end" and end["status"] == "failed" and end["error"].startswith("ChecksumMismatchError")


class CloseFails(LocalRuntime):
    closed = False

    def close(self) -> None:
        self.closed = True
        raise OSError("close failed")


def test_a_failing_close_after_a_training_error_does_not_hide_it(tmp_path, config):
    cfg = config(max_skipped_steps=1, eval_interval=0, save_interval=0)
    trainer = Trainer(cfg, CloseFails(cfg, torch.device("cpu")))
    with torch.no_grad():
        trainer.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(TrainingError, match="non-finite") as info:
        trainer.train()
    assert trainer.runtime.closed
    assert any("closing the runtime failed too: OSError: close failed" in n for n in info.value.__notes__)


def test_resuming_a_checkpoint_with_another_eval_set_warns_once_with_the_setting_that_keeps_it(tmp_path, config):
    """moe-train 0.3.0 stored train.eval_batches (x micro_batch_size windows); 0.4.0's train.eval_windows has
    another default, so a resume would splice two eval series silently."""
    cfg = config(eval_windows=8)  # micro_batch_size=4
    Trainer(cfg).train()
    meta_file = step_dir(tmp_path / "run" / "checkpoints", 2) / "metadata.json"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["train"]["eval_windows"]
    meta["config"]["train"]["eval_batches"] = 3  # as 0.3.0 wrote it: 12 windows
    rewrite_metadata(meta_file, meta)
    with pytest.warns(UserWarning) as got:
        Trainer(cfg).train()  # steps=2: restores, trains nothing
    [warning] = [str(w.message) for w in got if "nothing to train" not in str(w.message)]
    assert "eval losses before and after step 2 are not comparable" in warning
    assert "12 windows" in warning and "set train.eval_windows=12" in warning
    cfg.train.eval_windows = 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=r"train\.steps=2: the run is already at step 2")  # it is
        Trainer(cfg).train()
