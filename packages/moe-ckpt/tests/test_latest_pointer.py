"""`latest` naming a checkpoint that is no longer there: the run resolves to an older step, with a warning naming
both (before moe-ckpt 0.21.3 it rolled back without a word)."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from moe_ckpt import ShardSpec, find_latest, load_checkpoint, save_checkpoint, step_dir


def _save(root, step):
    save_checkpoint(step_dir(root, step), [ShardSpec("w", (3,), torch.full((3,), float(step)), writer=True)],
                    {"step": step}, 0, 1, None)


def _resolve_quietly(root):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return find_latest(root)


def test_a_pointer_to_a_deleted_checkpoint_warns_and_names_the_older_step(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    shutil.rmtree(step_dir(tmp_path, 2))
    with pytest.warns(UserWarning, match=r"latest names step-00000002, which is not a committed checkpoint.*"
                                         r"resolving to step-00000001"):
        found = find_latest(tmp_path)
    assert found == step_dir(tmp_path, 1)
    assert load_checkpoint(found)["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_pointer_to_a_checkpoint_that_lost_its_index_warns(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (step_dir(tmp_path, 2) / "index.json").unlink()
    with pytest.warns(UserWarning, match="step-00000002.*resolving to step-00000001"):
        assert find_latest(tmp_path) == step_dir(tmp_path, 1)


def test_a_pointer_to_nothing_left_says_there_is_nothing(tmp_path):
    _save(tmp_path, 1)
    shutil.rmtree(step_dir(tmp_path, 1))
    with pytest.warns(UserWarning, match="no committed checkpoint to resolve to"):
        assert find_latest(tmp_path) is None


def test_a_sound_pointer_a_pointer_one_behind_and_no_pointer_resolve_quietly(tmp_path):
    assert _resolve_quietly(tmp_path) is None
    _save(tmp_path, 1)
    assert _resolve_quietly(tmp_path) == step_dir(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "latest").write_text("step-00000001\n")  # a crash between the rename and the pointer update
    assert _resolve_quietly(tmp_path) == step_dir(tmp_path, 2)
    (tmp_path / "latest").unlink()
    assert _resolve_quietly(tmp_path) == step_dir(tmp_path, 2)


@pytest.mark.parametrize("damage", ["binary", "folder"])
def test_a_damaged_pointer_is_ignored_with_a_warning(tmp_path, damage):
    """0.21.3 as first written read the pointer on every resolution and raised UnicodeDecodeError / IsADirectoryError
    over a pointer it does not need (review helper 153)."""
    _save(tmp_path, 1)
    (tmp_path / "latest").unlink()
    if damage == "binary":
        (tmp_path / "latest").write_bytes(b"\xff\xfe\x00garbage")
    else:
        (tmp_path / "latest").mkdir()
    with pytest.warns(UserWarning, match="cannot be read as a pointer.*resolving to step-00000001"):
        assert find_latest(tmp_path) == step_dir(tmp_path, 1)


def test_a_pointer_to_a_checkpoint_saved_under_another_name_says_runs_resolve_to_step_names(tmp_path):
    """A save to run/final moves `latest` to it; 0.21.4 then warned that final was deleted or moved (review helper
    153): the warning now says it is there, and why the run resolves to a step folder instead."""
    _save(tmp_path, 1)
    save_checkpoint(tmp_path / "final", [ShardSpec("w", (3,), torch.full((3,), 9.0), writer=True)], {"step": 9}, 0, 1,
                    None)
    assert (tmp_path / "latest").read_text().strip() == "final"
    with pytest.warns(UserWarning, match=r"latest names final, a committed checkpoint, but runs resolve only to "
                                         r"folders named as step_dir names them \(resolving to step-00000001") as seen:
        assert find_latest(tmp_path) == step_dir(tmp_path, 1)
    assert not any("deleted" in str(w.message) for w in seen)


def test_a_pointer_to_a_symbolic_link_says_runs_never_resolve_to_links(tmp_path):
    """A link named step-00000007 to a checkpoint elsewhere: 0.21.8 said it was deleted, moved or had lost its
    index.json (review helper 157)."""
    _save(tmp_path / "elsewhere", 7)
    _save(tmp_path / "run", 1)
    (tmp_path / "run" / "step-00000007").symlink_to(step_dir(tmp_path / "elsewhere", 7))
    (tmp_path / "run" / "latest").write_text("step-00000007\n")
    with pytest.warns(UserWarning, match=r"latest names step-00000007, a symbolic link, which runs never resolve to "
                                         r"\(resolving to step-00000001"):
        assert find_latest(tmp_path / "run") == step_dir(tmp_path / "run", 1)


@pytest.mark.parametrize("text", ["../other-run/step-00000009", "/abs/step-00000009", "", "..", ".", "s" * 300],
                         ids=["relative path", "absolute path", "empty", "parent", "itself", "300 characters"])
def test_a_pointer_that_names_no_folder_inside_the_run_is_ignored_with_a_warning(tmp_path, text):
    """A pointer edited to a path (say into another run): 0.22.2 ignored it without a word, resolving to this run's
    newest checkpoint while the user believed it would take the one named (QA 153)."""
    _save(tmp_path / "other-run", 9)
    _save(tmp_path / "run", 1)
    (tmp_path / "run" / "latest").write_text(text + "\n")
    with pytest.warns(UserWarning, match=rf"latest holds '{text}', not the name of a folder inside the run .* "
                                         r"ignored; resolving to step-00000001"):
        assert find_latest(tmp_path / "run") == step_dir(tmp_path / "run", 1)
