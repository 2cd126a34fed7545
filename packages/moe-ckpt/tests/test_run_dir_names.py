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


def test_a_symlink_named_like_a_checkpoint_is_never_listed_resumed_or_touched_by_retention(tmp_path):
    """A link step-N -> another run's checkpoint. Before: it was listed, so find_latest resumed another run's
    state as this run's step, and retention renamed the user's link to step-N.tmp-delete-XXXXXXXX (its rmtree
    then failed quietly on the link, which stayed there for good). Now links are the user's, like backups."""
    other, run = tmp_path / "other", tmp_path / "run"
    target = _save(other, 1)
    run.mkdir()
    old_link, new_link = step_dir(run, 1), step_dir(run, 9)
    old_link.symlink_to(target, target_is_directory=True)
    assert list_checkpoints(run) == [] and find_latest(run) is None
    _save(run, 2)
    _save(run, 3, keep_last_n=1)
    new_link.symlink_to(target, target_is_directory=True)
    assert list_checkpoints(run) == [step_dir(run, 3)] and find_latest(run) == step_dir(run, 3)
    assert apply_retention(run, 1) == []
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-00000001", "step-00000003", "step-00000009"]
    assert old_link.is_symlink() and new_link.is_symlink()
    assert sorted(p.name for p in target.iterdir()) == ["index.json", "metadata.json",
                                                        "shard-00000-of-00001.safetensors"]


def test_retention_refuses_to_delete_through_a_symlink(tmp_path):
    from moe_ckpt.run_dir import remove_checkpoint

    target = _save(tmp_path / "other", 1)
    link = step_dir(tmp_path / "run", 1)
    link.parent.mkdir()
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"step-00000001 is not a checkpoint folder \(a symbolic link"):
        remove_checkpoint(link)
    assert link.is_symlink() and (target / "index.json").is_file()


def test_a_file_or_an_unfinished_folder_named_like_a_checkpoint_is_not_one(tmp_path):
    _save(tmp_path, 1)
    step_dir(tmp_path, 5).write_text("not a folder")
    step_dir(tmp_path, 6).mkdir()  # a save killed before its rename would have left step-6.tmp; this is by hand
    (step_dir(tmp_path, 6) / "shard-00000-of-00001.safetensors").write_bytes(b"\0" * 8)
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)] and find_latest(tmp_path) == step_dir(tmp_path, 1)
    _save(tmp_path, 2, keep_last_n=1)
    assert step_dir(tmp_path, 5).is_file() and step_dir(tmp_path, 6).is_dir()
    with pytest.raises(FileExistsError, match="step-00000005 already exists"):
        _save(tmp_path, 5)


def test_a_run_directory_without_its_latest_pointer_resolves_to_its_newest_checkpoint(tmp_path):
    """Before: with `latest` gone (deleted by hand, a copy that skipped it) load_checkpoint(run) said the run
    directory 'has no index.json: not a committed checkpoint' although find_latest found one."""
    from moe_ckpt import load_metadata

    for step in (1, 2):
        _save(tmp_path, step)
    (tmp_path / "latest").unlink()
    assert load_metadata(tmp_path)["step"] == 2
