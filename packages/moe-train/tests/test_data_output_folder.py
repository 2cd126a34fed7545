"""prepare-data's output folder: built under a temporary name and put in place so that `--out` is at every
moment absent, the old data folder whole or the new one whole; it never deletes what it did not write."""

import json
import os
import shutil

import pytest

from moe_train.data import DataError, open_data, prepare_data
from moe_train.data import prepare as prepare_mod

FILES = ["meta.json", "tokenizer.json", "train.u32", "eval.u32", "train.docs.u64", "eval.docs.u64"]
DOCS_A = [f"def a{i}(x):\n    return x + {i}\n" for i in range(60)]
DOCS_B = [f"class B{i}:\n    value = {i} * 2\n" for i in range(60)]


def corpus_hash(folder) -> str:
    return json.loads((folder / "meta.json").read_text())["corpus_sha256_16"]


def test_a_replace_killed_mid_delete_never_leaves_a_half_deleted_data_folder(tmp_path, monkeypatch):
    """The old folder used to be deleted in place, then the new one renamed in: a kill during the delete left
    `--out` with its meta.json but without some of its files (a docs file: open_data did not notice)."""
    out = prepare_data(DOCS_A, tmp_path / "d", vocab_size=300)
    old_hash = corpus_hash(out)
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        victim = os.path.join(path, "train.docs.u64")
        if os.path.exists(victim) and os.path.exists(os.path.join(path, "meta.json")):
            os.remove(victim)  # the delete got this far
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(prepare_mod.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(DOCS_B, out, vocab_size=300)
    monkeypatch.undo()
    # the new folder stands whole at `out`: the old one was renamed aside before its delete began
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert corpus_hash(out) != old_hash
    open_data(out, 300)
    prepare_data(DOCS_A, out, vocab_size=300)  # the next run cleans up what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_leftover_temporary_folders_of_killed_runs_are_removed(tmp_path):
    """A run killed mid-write (kill -9: no `except` runs) leaves d.tmp-PID; it is not data and goes next time."""
    dead = 2**22 + 12345  # above Linux's pid_max: no such process
    for name in (f"d.tmp-{dead}", f"d.old-{dead}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.u32").write_bytes(b"\0" * 8)
    (tmp_path / f"d.tmp-{os.getpid()}x").mkdir()  # not a leftover's name: left alone
    prepare_data(DOCS_A, tmp_path / "d", vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["d", f"d.tmp-{os.getpid()}x"])


def test_prepare_refuses_to_replace_a_data_folder_holding_files_it_did_not_write(tmp_path):
    """`prepare-data d --out d` (the corpus kept in the data folder) used to read the corpus, then delete it."""
    out = prepare_data(DOCS_A, tmp_path / "d", vocab_size=300)
    (out / "corpus.txt").write_text("my only copy")
    with pytest.raises(DataError, match=r"also holds \['corpus.txt'\], which prepare-data did not write"):
        prepare_data(DOCS_B, out, vocab_size=300)
    assert (out / "corpus.txt").read_text() == "my only copy"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_prepare_into_the_current_folder(tmp_path, monkeypatch):
    """`--out .` has no name to put a temporary suffix on; it is written through its absolute path."""
    out = prepare_data(DOCS_A, tmp_path / "d", vocab_size=300)
    old_hash = corpus_hash(out)
    monkeypatch.chdir(out)
    prepare_data(DOCS_B, ".", vocab_size=300)
    assert corpus_hash(tmp_path / "d") != old_hash
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    open_data(tmp_path / "d", 300)
