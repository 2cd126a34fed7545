"""QA 137 review of moe-train 0.22.0-0.22.4 (chunked loss, peer failures, Trainer.close) and what moe-parallel
0.10.10 changed under it.

Found, fixed:
- Trainer.close() (and the end of `with Trainer(cfg) as trainer:`) did not settle an async save in flight: after
  `trainer.save()` with train.async_save, close() closed the runtime (its process groups, the save's barrier group
  among them) and gave back the run folder's lock while the checkpoint was still being written; another job could
  take the folder mid-write, and a failed save was reported only on stderr at interpreter exit. close() now waits for
  the save first (its error raised from close(), the runtime still closed and the lock still given back); __exit__
  leaving with an exception adds close()'s error as a note instead of replacing it.
  `test_close_settles_an_async_save_in_flight` fails before (loop.py).
- peer_failure numbered every Trainer of the process, one-process ones too: a rank that alone built a one-process
  Trainer (rank 0 evaluating with a LocalRuntime, say) numbered its next multi-rank runs one ahead of the other
  ranks, so their failure records were under other keys: a one-rank failure was again reported as gloo's bare
  "Connection closed by peer" (or, after an earlier failed run, could name a stale error). Only multi-rank runs are
  numbered now. `test_a_one_process_trainer_on_rank_0_does_not_stop_the_peer_failure_from_being_named` fails before
  (peer_failure.py; 2 gloo ranks).

Found and fixed in config.py (the test fails on 0.22.4):
- A config with model.num_experts > 0 whose model.dense_layers lists every layer, with parallel.ep > 1, validates,
  then (since moe-parallel 0.10.10 refuses ep > 1 with no MoE layer) every rank fails inside Trainer() after its
  process groups and data are set up, with moe-parallel's ValueError ("expected such layers (e.g. moe_kernels' MoE
  layer), or ep=1"), which names neither model.dense_layers nor parallel.ep. It trained before (dense, nothing to
  split). The num_experts=0 case is a ConfigError at validate; now this one is too, naming both fields.

Held (probes, not all pinned here): the chunked loss against F.cross_entropy for h/weight in fp32, float64, bf16,
fp16 and mixed (fp32 h with bf16 weight, bf16 h with fp32 weight), a loss scaled before backward, non-contiguous h,
zero tokens, retain_graph and two backwards, CPU autocast; Transformer.loss chunked vs whole logits with and without
tied embeddings in fp32/float64/bf16 (same loss, gradients within 4e-8, the same parameters get gradients); an
lm_head replaced by a plain nn.Linear is refused naming its type; train.loss_chunk_tokens=True/2.5/'8' refused by
validate; close() idempotent, and when runtime.close() raises the lock and threads still go back (by reading).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

import moe_ckpt.async_save as async_save
from moe_train.config import ConfigError, validate
from moe_train.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
import qa135_worker as q135  # noqa: E402
import qa137_worker as w137  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from test_parallel_harness import small_config  # noqa: E402


def test_close_settles_an_async_save_in_flight(tmp_path, data_dir, make_config, monkeypatch):
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=1, async_save=True)
    cfg.data.path = str(data_dir)
    real = async_save.save_checkpoint
    started = threading.Event()

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        started.set()
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_save, "save_checkpoint", slow)
    trainer = Trainer(cfg)
    path = trainer.save()
    assert started.wait(5)
    trainer.close()
    busy = trainer.async_saver.busy
    trainer.async_saver.wait()
    assert not busy, "close() returned (run folder unlocked, groups closed) with the checkpoint still being written"
    assert path.is_dir() and not list(path.parent.glob("*.tmp"))


def test_a_save_failing_in_flight_is_raised_by_close_which_still_gives_the_folder_back(tmp_path, data_dir,
                                                                                       make_config, monkeypatch):
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=1, async_save=True)
    cfg.data.path = str(data_dir)

    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(0.2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(async_save, "save_checkpoint", fail)
    trainer = Trainer(cfg)
    trainer.save()
    with pytest.raises(OSError, match="No space left"):
        trainer.close()
    assert trainer.closed
    Trainer(cfg).close()  # the folder was given back all the same


def test_a_one_process_trainer_on_rank_0_does_not_stop_the_peer_failure_from_being_named(tmp_path):
    from moe_train.data import prepare_data, stdlib_documents

    data = prepare_data(list(stdlib_documents(60_000)), tmp_path / "data", vocab_size=512, source="stdlib-test")
    (tmp_path / "j").mkdir()
    job = q135.Job("raise", str(tmp_path / "j" / "run"), str(data), fault_rank=1, timeout_s=20.0)
    results = h.spawn_jobs(w137.worker, 2, [(job, True)], tmp_path / "out")
    r0, r1 = results[0][job.run_dir], results[1][job.run_dir]
    assert r1["error"] == "RuntimeError", r1
    assert "rank 1 of 2 failed (RuntimeError: qa135: injected failure on this rank)" in r0.get("message", ""), r0


def test_expert_parallelism_with_every_layer_dense_is_a_config_error(tmp_path):
    cfg = small_config(tmp_path)
    cfg.model.dense_layers = list(range(cfg.model.num_layers))
    cfg.parallel.dp = cfg.parallel.ep = 2
    try:
        validate(cfg)
    except ConfigError as e:
        assert "parallel.ep=2" in str(e) and "model.dense_layers=[0, 1]" in str(e)
        return
    raise AssertionError("validated: the run fails later, inside apply_expert_parallel")
