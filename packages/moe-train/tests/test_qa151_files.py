"""QA 151 (review helper 164's mutation audit of moe-train): checkpoints and data files. Each test fails on the
mutant it names and passes on the code: metadata without rng failing as a bare KeyError (C1); metadata of another
step than its folder's (C3); way_back advising the oldest readable checkpoint (C5) or one whose shard is truncated
(B7); an unwritable checkpoints/ passing the start probe (C14); eos_id == vocab_size accepted (T4); token files not
fsynced (T9); meta.json written in place (B3); a file put in --out during prepare-data deleted (P5); an EOS after
every piece of a long document (B11); a one-window split warned about (CC1); inspect of a step-N.tmp folder (CC4)."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
from metadata_edit import rewrite_metadata
from moe_ckpt import CorruptMetadataError
from moe_train.cli import main
from moe_train.cli_commands import _warn_of_a_split_shorter_than_a_window
from moe_train.config_io import build_config
from moe_train.data import prepare as prep
from moe_train.data import prepare_data, token_file
from moe_train.data.token_file import DataError, SplitWriter, open_data, read_meta
from moe_train.trainer import checkpoint as ckpt
from moe_train.trainer.loop import Trainer

# check_trainer_metadata refuses a checkpoint whose metadata.json lacks rank 0's generator states with a
# CorruptMetadataError naming the field (not a KeyError / TypeError from deep inside).


def test_missing_or_malformed_rng_is_named(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=1, save_interval=1, eval_interval=0)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    path = ckpt.latest(tmp_path / "run")
    saved = json.loads((path / "metadata.json").read_text())
    ckpt.check_trainer_metadata(path)
    for rng in ("absent", None, [1, 2]):
        meta = json.loads(json.dumps(saved))
        if rng == "absent":
            del meta["rng"]
        else:
            meta["rng"] = rng
        rewrite_metadata(path / "metadata.json", meta)
        with pytest.raises(CorruptMetadataError, match="rng"):
            ckpt.check_trainer_metadata(path)


def _run(tmp_path, data_dir, make_config, steps):
    cfg = make_config(tmp_path, steps=steps, save_interval=1, keep_last=10, eval_interval=0)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    return tmp_path / "run" / "checkpoints"


def test_a_step_other_than_its_folders_is_refused(tmp_path, data_dir, make_config):
    path = ckpt.latest(_run(tmp_path, data_dir, make_config, 1).parent)
    meta = json.loads((path / "metadata.json").read_text())
    meta["step"] = 7
    rewrite_metadata(path / "metadata.json", meta)
    with pytest.raises(CorruptMetadataError, match="step=7, expected 1"):
        ckpt.check_trainer_metadata(path)


def test_way_back_names_the_newest_older_checkpoint_that_reads(tmp_path, data_dir, make_config):
    root = _run(tmp_path, data_dir, make_config, 3)
    damaged = root / "step-00000003"
    (damaged / "metadata.json").write_text("{}")
    text = ckpt.way_back(damaged)
    assert "the newest older one that reads is step-00000002" in text, text


def test_an_unwritable_checkpoints_folder_is_refused_before_the_first_step(tmp_path):
    from moe_train.config import ConfigError

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to("/proc/self")  # a folder no one, root included, can make a folder in
    with pytest.raises(ConfigError, match="cannot make a folder in"):
        ckpt.check_run_dir_writable(run, saves=True)


def test_way_back_skips_an_older_checkpoint_whose_shard_is_truncated(tmp_path, data_dir, make_config):
    root = _run(tmp_path, data_dir, make_config, 3)
    (root / "step-00000003" / "metadata.json").write_text("{}")
    shards = sorted((root / "step-00000002").glob("*.safetensors"))
    assert shards
    with open(shards[0], "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    text = ckpt.way_back(root / "step-00000003")
    assert "the newest older one that reads is step-00000001" in text, text


# token_file: eos_id must be an id of the vocabulary; SplitWriter.finish puts both files on disk (fsync).


def _meta(eos_id, vocab_size=16):
    split = {"num_tokens": 0, "num_docs": 0, "max_token_id": -1}
    return {"format": token_file.FORMAT, "vocab_size": vocab_size, "eos_id": eos_id,
            "splits": {"train": dict(split), "eval": dict(split)}}


def test_eos_id_equal_to_vocab_size_is_refused(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps(_meta(eos_id=15)))
    assert read_meta(tmp_path / "meta.json")["eos_id"] == 15
    (tmp_path / "meta.json").write_text(json.dumps(_meta(eos_id=16)))
    with pytest.raises(DataError, match="eos_id=16, expected an id below its vocab_size=16"):
        read_meta(tmp_path / "meta.json")


def test_finish_fsyncs_the_token_and_document_files(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(token_file.os, "fsync", spy)
    with SplitWriter(tmp_path, "train", eos_id=0) as w:
        w.write(np.array([5, 6, 0, 7], dtype=np.uint32))
        assert w.finish() == (4, 2)
    assert sorted(synced) == ["train.docs.u64", "train.u32"]


def test_a_failed_meta_write_leaves_the_previous_meta_json_whole(tmp_path, monkeypatch):
    from moe_train.data.token_file import write_meta

    write_meta(tmp_path, {"v": 1})

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_file.os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        write_meta(tmp_path, {"v": 2, "pad": "x" * 10000})
    assert json.loads((tmp_path / "meta.json").read_text()) == {"v": 1}


# A file that is not prepare-data's, put into --out while prepare-data tokenizes, is not deleted by the replace:
# the folder is checked again before the new one is renamed in.


RACE_DOCS = [f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(40)]


def test_a_file_arriving_during_the_build_is_kept(tmp_path, monkeypatch):
    out = tmp_path / "data"
    prep.prepare_data(RACE_DOCS, out, vocab_size=300)
    real_build = prep._build

    def build_then_someone_writes(*args, **kwargs):
        real_build(*args, **kwargs)
        (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(prep, "_build", build_then_someone_writes)
    with pytest.raises(DataError, match="notes.txt"):
        prep.prepare_data(RACE_DOCS, out, vocab_size=300)
    assert (out / "notes.txt").read_text() == "mine"


# A document tokenized in pieces (piece_chars) still ends with one end-of-text token: the tokens are those of the
# whole document.


PIECE_DOCS = [" ".join(f"word{i % 37} value{i % 11}" for i in range(k * 50, k * 50 + 300)) for k in range(12)]


def _tokens(folder):
    meta = read_meta(folder / "meta.json")
    _, splits = open_data(folder, meta["vocab_size"])
    return meta["eos_id"], np.concatenate([np.asarray(splits["train"].tokens), np.asarray(splits["eval"].tokens)])


def test_pieces_give_one_eos_per_document(tmp_path):
    assert all(len(d) > 1000 for d in PIECE_DOCS)
    eos, pieces = _tokens(prepare_data(PIECE_DOCS, tmp_path / "p", vocab_size=300, eval_fraction=0.25, piece_chars=64))
    assert int((pieces == eos).sum()) == len(PIECE_DOCS)


# prepare-data / inspect warn of a split shorter than one window (seq_len + 1 tokens), not of one that holds one.


def test_a_split_of_exactly_one_window_is_not_warned_about():
    window = build_config(None, None, {}).data.seq_len + 1
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _warn_of_a_split_shorter_than_a_window(window, window)
    assert [str(w.message) for w in got] == []
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _warn_of_a_split_shorter_than_a_window(window, window - 1)
    assert len(got) == 1 and "the eval split" in str(got[0].message)


# inspect on an uncommitted save (step-N.tmp) says it is a partial checkpoint, not that the folder holds none.


def test_inspect_names_a_partial_checkpoint(tmp_path, capsys):
    partial = tmp_path / "step-00000001.tmp"
    partial.mkdir()
    assert main(["inspect", str(partial)]) != 0
    err = capsys.readouterr().err
    assert "partial checkpoint" in err and "holds no checkpoint" not in err, err


def test_prepare_data_puts_every_file_and_both_folders_on_disk_before_and_after_the_rename(tmp_path, monkeypatch):
    """tokenizer.json is fsynced like the token files and meta.json, the finished folder's entries before it is
    renamed into place and the parent's after (helper 164: tokenizer.json was saved without an fsync, and no folder
    was fsynced, so a power loss could leave an empty tokenizer.json beside fsynced token files)."""
    from moe_train.data import prepare as prep

    events: list[str] = []
    real_sync, real_replace = prep.fsync_path, prep.os.replace
    monkeypatch.setattr(prep, "fsync_path", lambda path: (events.append(f"sync {path}"), real_sync(path))[1])
    monkeypatch.setattr(prep.os, "replace", lambda a, b: (events.append(f"rename {a} {b}"), real_replace(a, b))[1])
    out = tmp_path / "data"
    prep.prepare_data(RACE_DOCS, out, vocab_size=300)
    tmp = f"{out}.tmp-{os.getpid()}"
    install = events.index(f"rename {tmp} {out}")
    assert events.index(f"sync {tmp}/tokenizer.json") < events.index(f"sync {tmp}") < install, events
    assert events[-1] == f"sync {tmp_path}", events


def test_a_file_system_that_cannot_fsync_folders_still_gets_its_data_folder(tmp_path, monkeypatch):
    """Some network and FUSE file systems refuse fsync on a folder (EINVAL): prepare-data goes on without it (helper
    168: the first 0.27.25 failed there with a bare OSError, after the new folder was in place). Another error on
    the parent, once the folder is installed, is a warning naming it, not a failure."""
    import errno
    import warnings

    from moe_train.data import prepare as prep

    real = os.fsync

    def no_folder_fsync(fd: int) -> None:
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    monkeypatch.setattr(token_file.os, "fsync", no_folder_fsync)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = prep.prepare_data(RACE_DOCS, tmp_path / "data", vocab_size=300)
    assert (out / "meta.json").is_file()

    def parent_fails(path):  # noqa: ANN001, ANN202
        if path == tmp_path:
            raise OSError(errno.EIO, f"fsync of {path}: Input/output error")
    monkeypatch.setattr(prep, "fsync_path", parent_fails)
    with pytest.warns(UserWarning, match=r"is in place, but its parent folder could not be put on disk"):
        prep.prepare_data(RACE_DOCS, tmp_path / "data", vocab_size=300)
    assert (tmp_path / "data" / "meta.json").is_file() and not list(tmp_path.glob("data.old-*"))
