"""The checkpoint format version (index.json's "version"): written by every save, checked by every reader before
anything else; and what readers say about a checkpoint whose save never committed."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
from ckpt_cases import bits_equal, make_state, run_ranks, shards_for

import moe_ckpt.load
from moe_ckpt import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptMetadataError,
    IncompleteCheckpointError,
    UnsupportedFormatVersionError,
    format_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    load_metadata,
    open_checkpoint,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)

WORLD = 2


@pytest.fixture
def saved(tmp_path):
    """(run folder, its one checkpoint, the state saved) written by 2 simulated ranks."""
    state = make_state(3)
    path = step_dir(tmp_path / "run", 4)
    run_ranks(WORLD, lambda r, bar: save_checkpoint(path, shards_for(state, r, WORLD), {"step": 4}, r, WORLD, bar))
    return tmp_path / "run", path, state


def _edit_index(ck, edit) -> None:
    idx = json.loads((ck / "index.json").read_text())
    edit(idx)
    (ck / "index.json").write_text(json.dumps(idx))


def _readers(ck):
    """Every public way to open a checkpoint, each a callable that reads it."""
    def open_and_read():
        with open_checkpoint(ck) as c:
            return c.read()

    return {"load_checkpoint": lambda: load_checkpoint(ck), "open_checkpoint": open_and_read,
            "verify_checkpoint": lambda: verify_checkpoint(ck), "load_metadata": lambda: load_metadata(ck),
            "inspect_checkpoint": lambda: inspect_checkpoint(ck), "format_checkpoint": lambda: format_checkpoint(ck)}


def test_a_save_records_the_format_version_in_index_json_only_and_inspect_shows_it(saved):
    run, ck, _ = saved
    assert json.loads((ck / "index.json").read_text())["version"] == FORMAT_VERSION == 1
    assert "format_version" not in load_metadata(ck)["moe_ckpt"]  # one place: metadata.json no longer repeats it
    assert inspect_checkpoint(run)["format_version"] == FORMAT_VERSION
    assert f"written by {WORLD} ranks, format version {FORMAT_VERSION}\n" in format_checkpoint(run)


def test_a_checkpoint_without_a_format_version_is_read_as_version_1(saved):
    """An index.json without the field is the layout of moe-ckpt <= 0.5.0: every reader keeps reading it."""
    run, ck, state = saved
    _edit_index(ck, lambda i: i.pop("version"))
    got = load_checkpoint(run)
    assert all(bits_equal(got[n], t) for n, t in state.items())
    with open_checkpoint(ck) as c:
        assert bits_equal(c.read()["experts.w1"], state["experts.w1"])
    assert verify_checkpoint(run) == ck and load_metadata(run)["step"] == 4
    assert inspect_checkpoint(run)["format_version"] == 1
    assert "format version 1" in format_checkpoint(run)


def test_a_newer_format_version_is_refused_by_every_reader_before_any_tensor_is_read(saved, monkeypatch):
    """The rest of a newer index.json may be laid out differently: the version is checked first, so the reader
    is told to upgrade instead of being shown a CorruptMetadataError about a field it does not know."""
    run, ck, _ = saved
    newer = FORMAT_VERSION + 1
    _edit_index(ck, lambda i: i.update(version=newer, tensors="in tensors.bin"))
    opened = []
    monkeypatch.setattr(moe_ckpt.load, "safe_open", lambda *a, **k: opened.append(a))
    monkeypatch.setattr(moe_ckpt.load, "file_checksum", lambda *a, **k: opened.append(a))
    for where in (ck, run):  # the checkpoint itself, and the run folder that resolves to it
        for name, read in _readers(where).items():
            with pytest.raises(UnsupportedFormatVersionError) as info:
                read()
            message = str(info.value)
            assert (f"checkpoint {ck} has format version {newer}; this moe-ckpt reads format versions up to "
                    f"{FORMAT_VERSION}") in message, name
            assert "upgrade" in message
            assert (info.value.path, info.value.version, info.value.supported) == (ck, newer, FORMAT_VERSION)
    assert opened == []
    assert issubclass(UnsupportedFormatVersionError, CheckpointError)
    again = pickle.loads(pickle.dumps(info.value))  # e.g. carried from a worker process
    assert str(again) == message and again.version == newer


@pytest.mark.parametrize("value", ["1", 1.0, True, 0, -1, None, [1]])
def test_a_malformed_format_version_is_a_corrupt_metadata_error_naming_the_field(saved, value):
    _, ck, _ = saved
    _edit_index(ck, lambda i: i.update(version=value))
    for name, read in _readers(ck).items():
        with pytest.raises(CorruptMetadataError) as info:
            read()
        assert (f"{ck / 'index.json'}: field 'version' (the checkpoint format version) is {json.dumps(value)}, "
                "expected an integer >= 1") in str(info.value), name


def test_an_index_of_another_format_is_a_corrupt_metadata_error_naming_the_field(saved):
    _, ck, _ = saved
    _edit_index(ck, lambda i: i.update(format="torch-dcp"))
    with pytest.raises(CorruptMetadataError, match=r"index.json: field 'format' is 'torch-dcp', expected 'moe-ckpt'"):
        load_checkpoint(ck)


# What a reader says about a checkpoint a crashed save left: only `<path>.tmp` exists.

def test_reading_a_checkpoint_whose_save_never_committed_says_so(saved):
    run, ck, _ = saved
    killed = step_dir(run, 8)
    tmp = killed.with_name(killed.name + ".tmp")
    tmp.mkdir()
    (tmp / "shard-00000-of-00002.safetensors").write_bytes(b"\0" * 64)  # half written when the save was killed
    never = rf"{killed} was never committed: step-00000008.tmp beside it is a save of it that is in progress or was"
    for read in _readers(killed).values():
        with pytest.raises(IncompleteCheckpointError, match=never):
            read()
    with pytest.raises(IncompleteCheckpointError, match=rf"{run / 'nowhere'} does not exist: not a checkpoint"):
        load_checkpoint(run / "nowhere")
    assert load_metadata(run)["step"] == 4  # the run folder still resolves to its committed checkpoint


def test_python_m_moe_ckpt_prints_the_summary_without_warnings_and_refuses_a_non_checkpoint(saved, tmp_path):
    """`python -m moe_ckpt.summary` ran the module twice (runpy's RuntimeWarning, as the package imports it)."""
    run, _, _ = saved
    cmd = [sys.executable, "-W", "error", "-m", "moe_ckpt"]
    good = subprocess.run([*cmd, str(run)], capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and good.stderr == "", good.stderr
    assert good.stdout == format_checkpoint(run) + "\n"
    bad = subprocess.run([*cmd, str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stdout == "", (bad.returncode, bad.stdout)
    assert bad.stderr == f"python -m moe_ckpt: {tmp_path / 'nowhere'} does not exist: not a checkpoint\n", bad.stderr
