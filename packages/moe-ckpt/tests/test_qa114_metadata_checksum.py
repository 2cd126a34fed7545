"""QA 114: metadata.json is covered by a checksum. The shard files were checksummed, metadata.json was not: an edit or a
bit flip that keeps it valid JSON ("step": 1200 -> 1300, a digit of the sampler index or the LR schedule) loaded
silently, and a resume went on from the wrong step and data position. A save now records metadata.json's size and
checksum in index.json ("metadata_file"); every reader of metadata.json (load_metadata, inspect_checkpoint,
format_checkpoint, `python -m moe_ckpt`, verify_checkpoint) checks the bytes it read against it. A checkpoint of an
earlier moe-ckpt (no record) loads as before. Real files, one process, the public save / load API."""

from __future__ import annotations

import json
import re
import zlib

import pytest
import torch

from moe_ckpt import (
    AsyncCheckpointer,
    CorruptMetadataError,
    IncompleteCheckpointError,
    ShardSpec,
    format_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    load_metadata,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)
from moe_ckpt.__main__ import main as cli_main

META = {"step": 1200, "sampler": {"index": 48213}, "lr_schedule": {"last_epoch": 1200, "base_lr": 0.0003}}
WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4)


def _shards() -> list[ShardSpec]:
    return [ShardSpec("w", (3, 4), WEIGHT)]


@pytest.fixture
def ck(tmp_path):
    return save_checkpoint(step_dir(tmp_path / "run", 1200), _shards(), META)


def _cli(path) -> str:
    """`python -m moe_ckpt PATH` in process: its exit status is 1 and the error is on stderr."""
    return str(cli_main([str(path)]))


READERS = {
    "load_metadata": load_metadata,
    "inspect_checkpoint": inspect_checkpoint,
    "format_checkpoint": format_checkpoint,
    "verify_checkpoint": verify_checkpoint,
}


def _index(ck) -> dict:
    return json.loads((ck / "index.json").read_text())


def _write_index(ck, idx: dict) -> None:
    (ck / "index.json").write_text(json.dumps(idx, indent=1))


def test_a_save_records_metadata_json_size_and_checksum_of_its_exact_bytes(ck):
    data = (ck / "metadata.json").read_bytes()
    idx = _index(ck)
    assert idx["checksum_algorithm"] == "crc32"
    assert idx["metadata_file"] == {"bytes": len(data), "checksum": f"{zlib.crc32(data):08x}"}
    assert idx["version"] == 1  # an optional field older readers ignore: no format version bump


def test_a_save_with_sha256_records_a_sha256_of_metadata_json(tmp_path):
    import hashlib

    ck = save_checkpoint(tmp_path / "ck", _shards(), META, checksum="sha256")
    data = (ck / "metadata.json").read_bytes()
    assert _index(ck)["metadata_file"]["checksum"] == hashlib.sha256(data).hexdigest()
    assert load_metadata(ck)["step"] == 1200


def test_an_untouched_checkpoint_loads_through_every_reader(ck):
    assert load_metadata(ck)["step"] == 1200
    assert load_metadata(ck.parent)["sampler"] == {"index": 48213}  # the run folder: its latest checkpoint
    assert inspect_checkpoint(ck)["metadata"]["lr_schedule"]["last_epoch"] == 1200
    assert "step: 1200" in format_checkpoint(ck)
    assert verify_checkpoint(ck) == ck
    assert torch.equal(load_checkpoint(ck)["w"], WEIGHT)


@pytest.mark.parametrize("edit", [
    ('"step": 1200', '"step": 1300'),
    ('"index": 48213', '"index": 48223'),
    ('"base_lr": 0.0003', '"base_lr": 0.0008'),
])
def test_a_changed_digit_in_metadata_json_is_refused_by_every_reader_naming_the_file_and_checksums(ck, edit):
    mpath = ck / "metadata.json"
    text = mpath.read_text()
    assert edit[0] in text
    mpath.write_text(text.replace(edit[0], edit[1]))  # still valid JSON, same length
    json.loads(mpath.read_text())
    want = _index(ck)["metadata_file"]["checksum"]
    got = f"{zlib.crc32(mpath.read_bytes()):08x}"
    for name, reader in READERS.items():
        with pytest.raises(CorruptMetadataError) as caught:
            reader(ck)
        msg = str(caught.value)
        assert msg.startswith(f"metadata file {mpath} has {len(text)} bytes, crc32 {got}; index.json says "
                              f"{len(text)} bytes, crc32 {want}: "), (name, msg)
        assert "resume from an earlier checkpoint" in msg, (name, msg)
    assert _cli(ck) == "1"


def test_a_truncated_metadata_json_is_refused_by_every_reader_naming_the_file_and_checksums(ck):
    mpath = ck / "metadata.json"
    data = mpath.read_bytes()
    mpath.write_bytes(data[: len(data) // 2])
    for name, reader in READERS.items():
        with pytest.raises(CorruptMetadataError) as caught:
            reader(ck)
        msg = str(caught.value)
        assert str(mpath) in msg and "is damaged (JSONDecodeError" in msg, (name, msg)
        assert re.search(rf"it has {len(data) // 2} bytes, crc32 [0-9a-f]{{8}}; index.json says {len(data)} bytes, "
                         rf"crc32 {_index(ck)['metadata_file']['checksum']}: truncated", msg), (name, msg)
    assert _cli(ck) == "1"


def test_a_truncation_that_stays_valid_json_is_refused(ck):
    """Cut at a point where the rest is still a JSON object (a save with no indentation can end anywhere)."""
    mpath = ck / "metadata.json"
    mpath.write_text(json.dumps({"step": 1200}))
    for reader in READERS.values():
        with pytest.raises(CorruptMetadataError, match=re.escape(f"metadata file {mpath} has 14 bytes")):
            reader(ck)


def _as_older_save(ck) -> None:
    """An index.json as moe-ckpt before QA 114 wrote it: the same fields less "metadata_file" (index.json carries no
    checksum of itself, so removing the key is all that differs)."""
    idx = _index(ck)
    del idx["metadata_file"]
    _write_index(ck, idx)


def test_a_checkpoint_of_an_earlier_moe_ckpt_without_the_record_loads_as_before(ck):
    _as_older_save(ck)
    assert load_metadata(ck)["step"] == 1200
    assert verify_checkpoint(ck) == ck
    assert torch.equal(load_checkpoint(ck)["w"], WEIGHT)
    mpath = ck / "metadata.json"  # unchecked, as before: an edit is read (nothing recorded to compare it with)
    mpath.write_text(mpath.read_text().replace('"step": 1200', '"step": 1300'))
    assert load_metadata(ck)["step"] == 1300
    assert inspect_checkpoint(ck)["metadata"]["step"] == 1300
    assert verify_checkpoint(ck) == ck


def test_verify_checkpoint_of_an_earlier_moe_ckpt_still_reads_its_metadata_json(ck):
    """No record to compare with, but a metadata.json that is damaged or missing is still refused by
    verify_checkpoint, as load_metadata refuses it (it passed verify_checkpoint in 0.19.0)."""
    _as_older_save(ck)
    mpath = ck / "metadata.json"
    mpath.write_text("[1, 2]")
    with pytest.raises(CorruptMetadataError, match="holds a JSON list"):
        verify_checkpoint(ck)
    mpath.unlink()
    with pytest.raises(IncompleteCheckpointError, match="has no metadata.json"):
        verify_checkpoint(ck)


@pytest.mark.parametrize("record", [
    "crc32",
    None,
    [168, "7357d3eb"],
    {"bytes": "168", "checksum": "7357d3eb"},
    {"bytes": -1, "checksum": "7357d3eb"},
    {"bytes": True, "checksum": "7357d3eb"},
    {"bytes": 168, "checksum": 7357},
    {"checksum": "7357d3eb"},
])
def test_a_malformed_metadata_record_in_index_json_is_a_corrupt_metadata_error_naming_the_field(ck, record):
    idx = _index(ck)
    idx["metadata_file"] = record
    _write_index(ck, idx)
    for name, reader in {**READERS, "load_checkpoint": load_checkpoint}.items():
        with pytest.raises(CorruptMetadataError) as caught:
            reader(ck)
        msg = str(caught.value)
        assert msg.startswith(f"{ck / 'index.json'} is damaged (ValueError: 'metadata_file' is "
                              f"{json.dumps(record)}, expected {{'bytes': int >= 0, 'checksum': str}}"), (name, msg)


def test_a_record_that_disagrees_with_an_untouched_metadata_json_is_refused(ck):
    """The record is index.json's: a changed record (not the file) is caught as well."""
    idx = _index(ck)
    idx["metadata_file"]["checksum"] = "00000000"
    _write_index(ck, idx)
    with pytest.raises(CorruptMetadataError, match=r"index.json says \d+ bytes, crc32 00000000"):
        load_metadata(ck)


def test_an_async_save_records_the_checksum_and_an_edit_of_its_metadata_is_refused(tmp_path):
    path = step_dir(tmp_path / "run", 7)
    with AsyncCheckpointer() as ckpt:
        ckpt.save(path, _shards(), {**META, "step": 7})
        ckpt.wait()
    data = (path / "metadata.json").read_bytes()
    assert _index(path)["metadata_file"] == {"bytes": len(data), "checksum": f"{zlib.crc32(data):08x}"}
    assert load_metadata(path)["step"] == 7
    (path / "metadata.json").write_bytes(data.replace(b'"step": 7', b'"step": 8'))
    with pytest.raises(CorruptMetadataError, match=re.escape(f"metadata file {path / 'metadata.json'} has")):
        load_metadata(path)


def test_format_checkpoint_shows_a_callers_notes_after_the_step_from_the_metadata_it_read(ck):
    """notes(metadata) -> lines after the step line, given the metadata format_checkpoint read and checked (a caller
    such as moe-train inspect read metadata.json a second time and spliced its line in by string search)."""
    seen = []

    def notes(meta):
        seen.append(meta)
        return [f"sampler index: {meta['sampler']['index']}", "note two"]

    lines = format_checkpoint(ck, notes=notes).split("\n")
    at = lines.index("step: 1200")
    assert lines[at + 1:at + 3] == ["sampler index: 48213", "note two"] and len(seen) == 1
    assert format_checkpoint(ck).split("\n")[at + 1].startswith("  w ")  # no notes: the tensor table follows
