"""Damaged checkpoints whose sizes and checksums still agree with index.json (a file rewritten by another tool,
an index edited by hand, a bug in a writer): every case is a CheckpointError naming the file and what was
expected, raised before any byte reaches the caller's buffers; never a KeyError, an AttributeError or
safetensors' own error."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_cases import bits_equal, edit_header, reseal

from moe_ckpt import (
    Box,
    CorruptMetadataError,
    CorruptShardError,
    FlatRange,
    LoadRequest,
    NonFiniteTensorError,
    ShardSpec,
    inspect_checkpoint,
    load_checkpoint,
    load_metadata,
    save_checkpoint,
)

SHARD0 = "shard-00000-of-00002.safetensors"


def _edit_index(ck, fn) -> None:
    idx = json.loads((ck / "index.json").read_text())
    fn(idx)
    (ck / "index.json").write_text(json.dumps(idx))


@pytest.mark.parametrize(("fields", "stored"), [({"dtype": "I32"}, r"I32 \[7, 5\]"),
                                                ({"shape": [5, 7]}, r"F32 \[5, 7\]"),
                                                ({"shape": [35]}, r"F32 \[35\]")])
def test_a_shard_header_that_disagrees_with_the_index_is_refused(ck2, fields, stored):
    """Before: a dtype lie loaded int32 bits as the float32 tensor without a word, a shape lie was a
    RuntimeError / IndexError from deep inside the reader."""
    edit_header(ck2 / SHARD0, "attn.w[0:7,0:5]", **fields)
    reseal(ck2)
    with pytest.raises(CorruptShardError, match=rf"{SHARD0}: 'attn.w\[0:7,0:5\]' is stored as {stored}; "
                                                rf"index.json says F32 \[7, 5\]"):
        load_checkpoint(ck2, [LoadRequest("attn.w")])


def test_an_unreadable_or_foreign_shard_is_refused_naming_the_file(ck2):
    (ck2 / SHARD0).write_bytes(b"")
    reseal(ck2)
    with pytest.raises(CorruptShardError, match=rf"{SHARD0} is not a readable safetensors file"):
        load_checkpoint(ck2, verify=False)
    (ck2 / SHARD0).write_bytes((ck2 / "shard-00001-of-00002.safetensors").read_bytes())  # another rank's file
    reseal(ck2)
    with pytest.raises(CorruptShardError, match=rf"{SHARD0} has no tensor 'attn.w\[0:7,0:5\]', which index.json "
                                                "lists as a piece of 'attn.w'"):
        load_checkpoint(ck2)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda i: i["files"].pop(SHARD0), r"'files' holds shard files of ranks \[1\], expected one per rank 0..1"),
    (lambda i: i["tensors"]["attn.w"]["pieces"][0].update(file="nope.safetensors"),
     r"tensor 'attn.w': piece .* does not name a key and a file listed in 'files'"),
    (lambda i: i["files"].update({"../elsewhere.safetensors": {"rank": 2, "bytes": 0, "checksum": "0"}}),
     r"file name '../elsewhere.safetensors' is not a plain file name"),
    (lambda i: i["files"][SHARD0].pop("bytes"), rf"file '{SHARD0}': record .*, expected"),
    (lambda i: i["tensors"]["experts.w1"]["pieces"][1].update(box=[[4, 8], [0, 6], [0, 5]]),
     r"tensor 'experts.w1': piece 'experts.w1\[4:8,0:6,0:5\]': box \[4:12,0:6,0:5\] exceeds dim 0 of "
     r"global shape \(8, 6, 5\)"),
    (lambda i: i["tensors"]["attn.w"].update(dtype="float99"), r"tensor 'attn.w': dtype 'float99', expected one of"),
    (lambda i: i.update(tensors=[]), r"'tensors' is list, expected an object"),
    (lambda i: i.update(world_size=3),
     r"'files' holds shard files of ranks \[0, 1\], expected one per rank 0..2 \(world_size=3\)"),
])
def test_a_malformed_index_is_a_corrupt_metadata_error_naming_the_entry(ck2, edit, message):
    """Before: KeyError / AttributeError / TypeError, or (box past the tensor's end) no error at all."""
    _edit_index(ck2, edit)
    with pytest.raises(CorruptMetadataError, match=rf"{ck2 / 'index.json'} is damaged \(ValueError: {message}"):
        load_checkpoint(ck2)
    with pytest.raises(CorruptMetadataError):
        inspect_checkpoint(ck2)


def test_a_piece_listed_twice_is_an_overlap_not_a_missing_shard(ck2):
    _edit_index(ck2, lambda i: i["tensors"]["experts.w1"]["pieces"].append(i["tensors"]["experts.w1"]["pieces"][0]))
    with pytest.raises(CorruptMetadataError, match=r"'experts.w1' \(8, 6, 5\): index.json of .* lists pieces that "
                                                   r"overlap \(360 elements read for the 240"):
        load_checkpoint(ck2, [LoadRequest("experts.w1")])


def test_metadata_that_is_not_a_json_object_is_refused(ck2):
    """Before: load_metadata returned the list and the trainer's resume died on list.get (AttributeError)."""
    (ck2 / "metadata.json").write_text("[1, 2]")
    with pytest.raises(CorruptMetadataError, match=r"metadata.json holds a JSON list, expected an object"):
        load_metadata(ck2)


def test_an_index_json_that_is_a_folder_is_a_checkpoint_error(ck2):
    (ck2 / "index.json").unlink()
    (ck2 / "index.json").mkdir()
    with pytest.raises(CorruptMetadataError, match=r"index.json is not a file"):
        load_checkpoint(ck2)


def test_require_finite_refuses_nan_and_inf_before_filling_the_callers_buffer(tmp_path):
    """A NaN master weight is never a valid resume point: require_finite names the tensor, the region and the
    counts, and a request's `out` is left as it was. Without the flag the values round-trip bit for bit."""
    w = torch.arange(24.0).reshape(6, 4)
    w[4, 1], w[5, 3] = float("nan"), float("inf")
    ck = save_checkpoint(tmp_path / "ck", [ShardSpec("w", (6, 4), w[:3], FlatRange(0, 12)),
                                           ShardSpec("w", (6, 4), w[3:], FlatRange(12, 12)),
                                           ShardSpec("n", (2,), torch.ones(2)),
                                           ShardSpec("i", (1,), torch.ones(1, dtype=torch.int64))])
    out = torch.full((6, 4), -1.0)
    with pytest.raises(NonFiniteTensorError, match=r"'w' in .*ck: \[3:6,0:4\] holds 1 NaN and 1 Inf of 12 values "
                                                   r"\(first at flat index 5 of that region\)"):
        load_checkpoint(tmp_path / "ck", [LoadRequest("w", out=out)], require_finite=True)
    assert bool((out == -1).all())
    with pytest.raises(NonFiniteTensorError, match=r"'w' .*flat\[16:24\] holds 1 NaN and 1 Inf of 8 values"):
        load_checkpoint(ck, [LoadRequest("w", region=FlatRange(16, 8))], require_finite=True)
    got = load_checkpoint(ck, [LoadRequest("n"), LoadRequest("i"), LoadRequest("w", region=FlatRange(0, 12))],
                          require_finite=True)
    assert torch.equal(got["w"], torch.arange(12.0))
    assert bits_equal(load_checkpoint(ck)["w"], w)  # the flag is opt-in: NaN and Inf round-trip without it


def test_a_flat_range_piece_given_as_a_shaped_tensor_reads_back_in_any_layout(tmp_path):
    """ShardSpec accepts a FlatRange's data in any shape; it was stored with that shape and every read but a
    whole-tensor one sliced the wrong dimension (a RuntimeError, or wrong rows)."""
    w = torch.arange(12.0).reshape(4, 3)
    ck = save_checkpoint(tmp_path / "ck", [ShardSpec("w", (4, 3), w[:2], FlatRange(0, 6)),
                                           ShardSpec("w", (4, 3), w[2:], FlatRange(6, 6))])
    got = load_checkpoint(ck, [LoadRequest("w", region=FlatRange(1, 4))])["w"]
    assert torch.equal(got, torch.arange(1.0, 5.0))
    assert torch.equal(load_checkpoint(ck, [LoadRequest("w", region=Box((1, 1), (2, 2)))])["w"], w[1:3, 1:3])
