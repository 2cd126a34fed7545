"""QA 117 review of moe-ckpt 0.19.0 (metadata.json checksummed in index.json): what held, kept as tests. An editor's
change that leaves the values alone (a UTF-8 BOM, CRLF line endings, a final newline) is still a change of the bytes
the save recorded, refused by every reader naming the file; a record with no metadata.json beside it is an
incomplete checkpoint, not a metadata mismatch."""

from __future__ import annotations

import pytest
import torch

from moe_ckpt import (
    CorruptMetadataError,
    IncompleteCheckpointError,
    ShardSpec,
    inspect_checkpoint,
    load_metadata,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)

EDITS = {"utf-8 BOM": lambda b: b"\xef\xbb\xbf" + b, "CRLF": lambda b: b.replace(b"\n", b"\r\n"),
         "final newline": lambda b: b + b"\n"}


@pytest.fixture(params=["crc32", "sha256"])
def ck(tmp_path, request):
    return save_checkpoint(step_dir(tmp_path / "run", 7), [ShardSpec("w", (2,), torch.ones(2))], {"step": 7},
                           checksum=request.param)


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("reader", [load_metadata, inspect_checkpoint, verify_checkpoint])
def test_an_editors_bom_crlf_or_newline_is_refused_as_a_changed_metadata_json_naming_it(ck, edit, reader):
    meta = ck / "metadata.json"
    meta.write_bytes(EDITS[edit](meta.read_bytes()))
    with pytest.raises(CorruptMetadataError, match="edited or corrupt since the save") as caught:
        reader(ck)
    assert str(meta) in str(caught.value) and "put back a copy of this file" in str(caught.value)


def test_a_recorded_metadata_json_that_is_missing_is_an_incomplete_checkpoint(ck):
    (ck / "metadata.json").unlink()
    for reader in (load_metadata, verify_checkpoint):
        with pytest.raises(IncompleteCheckpointError, match="has no metadata.json"):
            reader(ck)
