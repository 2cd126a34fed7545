"""QA 109 through the trainer: an I/O error (EIO) at one read of the Trainer's resume, on one process and on two gloo
ranks (DDP, parallel.collective_timeout_s=5), with moe-ckpt's fault injector (its tests/fs_faults.py, Faults(root,
reads=True): stat, listdir, open, fstat, reads, safe_open; every read operation of a load is tried in moe-ckpt's
tests/test_qa109.py). The resume reads under checkpoints/ in three places: find_resume_point's checks (inside one
fail_together), then moe_train.trainer.checkpoint.load's tensor reads and its load_metadata(path) (inside
another). One case per rank scenario:
- one process: safe_open of the shard file fails;
- rank 1 alone: safe_open of its own shard file, inside load's fail_together;
- both ranks, at different phases: rank 0 reading index.json in the resume checks, rank 1 a read of its shard's
  checksum pass in load (never reached: both stop at the first phase);
- rank 0 alone: its last read, metadata.json in load's final load_metadata.
Expected: every rank raises within 2 s (well before the 5 s collective timeout); the rank at fault raises an
OSError naming the file, not a damaged-checkpoint error (which would tell the user to move the checkpoint aside);
the other rank says that rank failed (PeerCheckpointError); nothing under checkpoints/ changes.

Found: 1. (moe-ckpt, fixed there) an I/O error opening a shard was CorruptShardError, so the Trainer said "cannot be
resumed from ... move it aside" for a read the disk failed. 2. (moe-train) checkpoint.load read metadata.json after
its fail_together: a read error there on rank 0 raised on rank 0 alone; rank 1 went on to its next collective and
failed there with gloo's "Connection closed by peer" naming neither the file nor the rank, and only because rank 0's
Trainer destroys its process group on the way out (a rank that kept its group would leave the others waiting for the
collective timeout). The metadata is now read inside the fail_together. 3. (moe-train) the rank whose read succeeded
said of the other's failure "checkpoint ... cannot be resumed from ... move it aside": a peer's failure now passes
unchanged (that rank's own error names its cause, with the way back when its file is damaged).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import test_parallel_harness as h
from ckpt_faults import faults_module
from moe_ckpt import CheckpointError
from train_qa109_worker import CASES, TIMEOUT_S, pick, rank_main, snapshot


@pytest.fixture(scope="module")
def two_ranks(_prepared_data, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("qa109")
    data = shutil.copytree(_prepared_data, root / "data")
    ports = [h.free_port() for _ in range(2 + len(CASES))]
    h.start_ranks(rank_main, args=(ports, str(root), str(data)), nprocs=2)
    reports = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, rep in enumerate(reports):
        assert "crash" not in rep, f"rank {r}:\n{rep['crash']}"
    assert all(rep["unchanged"] for rep in reports), "a resume changed the checkpoint folder"
    return reports


def _check(reports: list[dict], case: str) -> None:
    pair = [rep[case] for rep in reports]
    where = f"{case}: " + "; ".join(f"rank {r} {c['failed']} -> {c['error']}: {c['message'][:300]}"
                                     for r, c in enumerate(pair))
    faulted = [r for r in range(2) if pair[r]["failed"] is not None]
    assert faulted, where
    for r, c in enumerate(pair):
        assert c["error"] is not None and c["seconds"] < TIMEOUT_S / 2.5, where
        if r in faulted and c["error"] != "PeerCheckpointError":
            assert c["error"] == "OSError" and Path(c["failed"][1]).name in c["message"], where
            assert not c["damaged"], where  # a disk's read error is not a damaged checkpoint
        elif r not in faulted:
            assert c["error"] == "PeerCheckpointError" and f"rank {faulted[0]}" in c["message"], where
            assert not c["damaged"], where  # this rank read its part: nothing here says the checkpoint is damaged


@pytest.mark.parametrize("case", CASES)
def test_a_read_error_on_one_or_both_ranks_of_a_resume_fails_every_rank_at_once(two_ranks, case):
    """"rank 0" is the last read of the resume, metadata.json, on rank 0 alone."""
    _check(two_ranks, case)


@pytest.mark.filterwarnings("ignore:train.steps=1. the run is already at step 1:UserWarning")
def test_one_process_a_read_error_opening_the_shard_is_no_damaged_checkpoint(tmp_path, data_dir, make_config,
                                                                             monkeypatch):
    from moe_train.trainer.loop import Trainer

    cfg = make_config(tmp_path, steps=1, save_interval=1, eval_interval=0, log_interval=1, grad_accum=1,
                      warmup_steps=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    root = tmp_path / "run" / "checkpoints"
    before = snapshot(root)
    ff = faults_module()
    counted = ff.Faults(root, reads=True)
    with counted.active(monkeypatch):
        Trainer(cfg).train()
    at = pick(counted.ops, "safe_open", "shard-00000-of-00001.safetensors")
    with ff.Faults(root, reads=True).active(monkeypatch, fail_at=at, kind="EIO"), pytest.raises(OSError) as caught:
        Trainer(cfg).train()
    assert "shard-00000-of-00001.safetensors" in str(caught.value), caught.value
    assert not isinstance(caught.value, CheckpointError), caught.value  # not "cannot be resumed: move it aside"
    assert snapshot(root) == before
