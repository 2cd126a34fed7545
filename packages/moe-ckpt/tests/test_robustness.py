"""Leftovers of failed or killed saves, step-folder names, and a load that fails on one rank only."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
from ckpt_cases import make_state, run_ranks, shards_for
from moe_ckpt_dist_worker import load_with_one_corrupt_shard

from moe_ckpt import (
    Box,
    CheckpointError,
    LayoutError,
    ShardSpec,
    find_latest,
    list_checkpoints,
    save_checkpoint,
    step_dir,
    step_of,
)


def test_step_of_inverts_step_dir_and_rejects_other_names(tmp_path):
    for step in (0, 7, 12_345_678, 123_456_789):
        assert step_of(step_dir(tmp_path, step)) == step
        assert step_of(step_dir(tmp_path, step).name) == step
    for name in ("step-1", "step-000000001", "step-00000001.tmp", "step-0000000a", "latest", "xstep-00000001",
                 "step-00000001-old", ""):
        assert step_of(name) is None, name


def test_a_save_removes_stale_tmp_folders_of_earlier_saves_and_nothing_else(tmp_path):
    state = make_state()
    committed = save_checkpoint(step_dir(tmp_path, 1), shards_for(state, 0, 1), {"step": 1})
    stale = [tmp_path / "step-00000002.tmp", tmp_path / "step-00000001.tmp-delete-0badc0de"]
    for d in stale:  # a killed save (half a shard file) and a killed retention delete
        d.mkdir()
        (d / "shard-00000-of-00001.safetensors").write_bytes(b"\0" * 100)
    stale_pointer = tmp_path / f".latest.tmp-{'ab' * 16}"
    stale_pointer.write_text("step-00000002\n")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    not_ours = [tmp_path / "step-1.tmp", tmp_path / "notes.tmp", tmp_path / "step-00000003.tmpdir",
                tmp_path / "step-00000004.tmp-delete-xyz", tmp_path / "step-00000005.tmp-delete-0BADC0DE"]
    for d in not_ours:
        d.mkdir()
    (tmp_path / "step-00000006.tmp").write_text("a file, not a folder we made")
    (tmp_path / "step-00000007.tmp").symlink_to(outside, target_is_directory=True)
    (tmp_path / ".latest.tmp-mine").write_text("x")

    save_checkpoint(step_dir(tmp_path, 3), shards_for(state, 0, 1), {"step": 3})

    assert not any(p.exists() for p in [*stale, stale_pointer])
    assert all(p.is_dir() for p in not_ours)
    assert (tmp_path / "step-00000006.tmp").is_file() and (tmp_path / ".latest.tmp-mine").is_file()
    assert (tmp_path / "step-00000007.tmp").is_symlink() and (outside / "keep").is_file()
    assert list_checkpoints(tmp_path) == [committed, step_dir(tmp_path, 3)]
    assert find_latest(tmp_path) == step_dir(tmp_path, 3)


def test_a_failed_save_removes_its_tmp_folder(tmp_path):
    w = torch.ones(4, 2)
    with pytest.raises(LayoutError, match="saved pieces cover 8 of 16"):
        save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (8, 2), w, Box.dim0((8, 2), 0, 4))])
    assert sorted(os.listdir(tmp_path)) == []


def test_a_save_that_fails_on_every_rank_removes_its_tmp_folder_after_all_ranks_read_the_error(tmp_path):
    w = torch.ones(4, 2)
    errors = []

    def rank(r, bar):
        calls = 0

        def barrier() -> None:
            nonlocal calls
            bar()
            calls += 1
            if r == 1 and calls == 3:  # rank 1 is slow to read the error records after the commit barrier
                time.sleep(0.3)

        try:
            save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (4, 2), w, writer=True)], None, r, 2, barrier)
        except CheckpointError as e:
            errors.append(str(e))

    run_ranks(2, rank)
    assert len(errors) == 2 and all("overlap" in e for e in errors), errors  # both read rank 0's record
    assert sorted(os.listdir(tmp_path)) == []


def test_an_interrupted_save_removes_its_tmp_folder(tmp_path):
    """Ctrl-C (or any exception) inside the save: nothing committed, nothing left behind."""
    calls = 0

    def interrupting_barrier() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # every shard written, not yet committed
            raise KeyboardInterrupt

    state = make_state()
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(step_dir(tmp_path, 1), shards_for(state, 0, 2)[:1], None, 0, 2, interrupting_barrier)
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.slow
def test_a_corrupt_shard_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    """Rank 1's shard file is damaged; only rank 1 reads it. Both ranks raise at once: rank 1 with the
    checksum error, rank 0 naming rank 1 (before, rank 0 went on and waited at its next collective)."""
    mp.spawn(load_with_one_corrupt_shard, args=(2, str(tmp_path)), nprocs=2, join=True)
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    assert got[1]["error"] == "ChecksumMismatchError" and "shard-00001-of-00002.safetensors" in got[1]["message"]
    assert got[0]["error"] == "PeerCheckpointError"
    assert "failed on rank 1 of 2" in got[0]["message"] and "step-00000001" in got[0]["message"]
    assert all(got[r]["seconds"] < 20 for r in range(2)), got
    assert got[0]["then"] == got[1]["then"] == "ok"  # the group is still usable after the failure


def test_the_agreement_is_free_on_one_rank():
    from moe_ckpt import fail_together

    assert fail_together(lambda: 5, 0, 1, None) == 5
    with pytest.raises(ZeroDivisionError):
        fail_together(lambda: 1 / 0, 0, 1, None)
