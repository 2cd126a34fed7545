"""Which names in a run directory are moe-ckpt's: only step_dir's exact names are checkpoints, and a
symlink at a name a save uses is refused, never followed."""

from __future__ import annotations

import shutil

import pytest
from ckpt_cases import make_state, shards_for

from moe_ckpt import CheckpointError, apply_retention, find_latest, list_checkpoints, save_checkpoint, step_dir


def _save(root, step, **kw):
    return save_checkpoint(step_dir(root, step), shards_for(make_state(step), 0, 1), {"step": step}, **kw)


def test_backup_copies_beside_checkpoints_are_never_listed_resumed_or_deleted(tmp_path):
    """A user's copy of a checkpoint holds an index.json too; retention must not delete it and
    resume must not pick it (step-00000003.bak sorted after step-00000003 by name)."""
    _save(tmp_path, 3)
    copies = ["step-00000003.bak", "backup-before-lr-change", "step-3", "step-00000009-old"]
    for name in copies:
        shutil.copytree(step_dir(tmp_path, 3), tmp_path / name)
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 3)]
    assert find_latest(tmp_path) == step_dir(tmp_path, 3)
    for step in (4, 5):
        _save(tmp_path, step, keep_last_n=1)
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 5)]
    assert apply_retention(tmp_path, 1) == []
    assert all((tmp_path / name / "index.json").is_file() for name in copies)


def test_checkpoints_are_ordered_by_step_past_eight_digits(tmp_path):
    for step in (99_999_999, 100_000_000, 7):
        _save(tmp_path, step)
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, s) for s in (7, 99_999_999, 100_000_000)]


def test_a_symlink_at_the_tmp_name_is_refused_and_nothing_is_written_through_it(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "step-00000002.tmp").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=r"step-00000002\.tmp is a symbolic link to .*elsewhere"):
        _save(run, 2)
    assert list(elsewhere.iterdir()) == []  # no error record, no shard through the link
    assert (run / "step-00000002.tmp").is_symlink() and not step_dir(run, 2).exists()


def test_another_rank_never_writes_through_a_symlinked_tmp_folder(tmp_path):
    """Rank 1 reaches its write phase whatever rank 0 found: it must not take the link for rank 0's folder."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "step-00000002.tmp").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="is not a folder"):
        save_checkpoint(step_dir(run, 2), shards_for(make_state(), 1, 2), {"step": 2}, 1, 2, lambda: None)
    assert list(elsewhere.iterdir()) == []


def test_a_dangling_symlink_at_the_checkpoint_name_is_refused(tmp_path):
    step_dir(tmp_path, 2).symlink_to(tmp_path / "gone")
    with pytest.raises(FileExistsError, match="step-00000002 already exists"):
        _save(tmp_path, 2)
    assert not (tmp_path / "gone").exists() and not (tmp_path / "step-00000002.tmp").exists()
