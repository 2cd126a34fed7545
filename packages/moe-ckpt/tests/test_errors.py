import json

import pytest
import torch
from ckpt_cases import requests_for, run_ranks

from moe_ckpt import (
    Box,
    ChecksumMismatchError,
    DtypeMismatchError,
    FlatRange,
    IncompleteCheckpointError,
    LayoutError,
    LoadRequest,
    MissingShardFileError,
    ShapeMismatchError,
    ShardSpec,
    TensorNotFoundError,
    UncoveredRegionError,
    load_checkpoint,
    save_checkpoint,
)


def test_flipped_byte_is_a_checksum_error_naming_the_file(ck2):
    f = ck2 / "shard-00001-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40  # inside the tensor bytes: safetensors itself would not notice
    f.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"shard-00001-of-00002\.safetensors has crc32 .* corrupt"):
        load_checkpoint(ck2)
    load_checkpoint(ck2, verify=False)  # verify=False skips the checksum pass (size still checked)


def test_truncated_file_is_reported_with_both_sizes(ck2):
    f = ck2 / "shard-00000-of-00002.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 16)
    with pytest.raises(ChecksumMismatchError, match=rf"shard-00000-of-00002.safetensors has {size - 16} bytes, index.json says {size}"):
        load_checkpoint(ck2, verify=False)


def test_missing_shard_file_names_the_file_and_rank(ck2):
    (ck2 / "shard-00001-of-00002.safetensors").unlink()
    with pytest.raises(MissingShardFileError, match=r"shard-00001-of-00002.safetensors \(rank 1 of 2\) is missing"):
        load_checkpoint(ck2)
    # a request that needs only rank 0's rows does not touch the missing file
    got = load_checkpoint(ck2, [LoadRequest("experts.w1", region=Box.dim0((8, 6, 5), 0, 4))])
    assert got["experts.w1"].shape == (4, 6, 5)


def test_piece_missing_from_the_index_is_an_uncovered_region(ck2):
    idx = json.loads((ck2 / "index.json").read_text())
    idx["tensors"]["experts.w1"]["pieces"].pop(1)  # rank 1's rows 4:8
    (ck2 / "index.json").write_text(json.dumps(idx))
    with pytest.raises(UncoveredRegionError, match=r"'experts.w1' \(8, 6, 5\): the saved pieces cover 120 of the 240"):
        load_checkpoint(ck2, [LoadRequest("experts.w1")])
    load_checkpoint(ck2, [LoadRequest("experts.w1", region=Box.dim0((8, 6, 5), 0, 4))])


def test_shape_mismatch_names_tensor_and_both_shapes(ck2):
    with pytest.raises(ShapeMismatchError, match=r"'experts.w1': requested global shape \(16, 6, 5\), checkpoint has \(8, 6, 5\)"):
        load_checkpoint(ck2, [LoadRequest("experts.w1", (16, 6, 5))])


def test_dtype_mismatch_names_both_dtypes(ck2):
    with pytest.raises(DtypeMismatchError, match="'norm.b': requested dtype float32, checkpoint has bfloat16"):
        load_checkpoint(ck2, [LoadRequest("norm.b", (3,), torch.float32)])


def test_unknown_tensor_is_named(ck2):
    with pytest.raises(TensorNotFoundError, match=r"\['experts.w9'\] are not in the checkpoint"):
        load_checkpoint(ck2, requests_for(0, 1, "whole") + [LoadRequest("experts.w9")])


def test_request_outside_the_tensor_is_refused(ck2):
    with pytest.raises(ValueError, match=r"flat\[200:260\] exceeds numel 240"):
        load_checkpoint(ck2, [LoadRequest("experts.w1", region=FlatRange(200, 60))])


def test_partial_tmp_directory_is_refused(ck2):
    ck2.rename(ck2.with_name("ck.tmp"))
    with pytest.raises(IncompleteCheckpointError, match="partial checkpoint"):
        load_checkpoint(ck2.with_name("ck.tmp"))
    (ck2.parent / "plain").mkdir()
    with pytest.raises(IncompleteCheckpointError, match="no index.json"):
        load_checkpoint(ck2.parent / "plain")


def test_two_writers_of_a_replicated_tensor_fail_on_every_rank(tmp_path):
    w = torch.ones(4, 2)
    errors = []

    def rank(r, bar):
        try:
            save_checkpoint(tmp_path / "ck", [ShardSpec("w", (4, 2), w, writer=True)], None, r, 2, bar)
        except Exception as e:
            errors.append(e)

    run_ranks(2, rank)
    assert len(errors) == 2, "both ranks must raise, neither may hang"
    assert any(isinstance(e, LayoutError) and "overlap" in str(e) for e in errors)
    assert not (tmp_path / "ck").exists()


def test_a_gap_in_the_saved_layout_is_refused_at_save(tmp_path):
    w = torch.ones(4, 2)
    with pytest.raises(LayoutError, match=r"tensor 'w' of shape \(8, 2\): saved pieces cover 8 of 16"):
        save_checkpoint(tmp_path / "ck", [ShardSpec("w", (8, 2), w, Box.dim0((8, 2), 0, 4))])


def test_saving_over_an_existing_checkpoint_is_refused(ck2):
    with pytest.raises(FileExistsError, match="already exists"):
        save_checkpoint(ck2, [ShardSpec("x", (1,), torch.ones(1))])


def test_local_data_must_match_its_region():
    with pytest.raises(ValueError, match=r"local data has shape \(3, 2\).* needs \(4, 2\)"):
        ShardSpec("w", (8, 2), torch.ones(3, 2), Box.dim0((8, 2), 4, 4))


def test_verify_checkpoint_checks_every_file_once(tmp_path):
    import torch

    from moe_ckpt import ChecksumMismatchError, ShardSpec, save_checkpoint, verify_checkpoint

    path = save_checkpoint(tmp_path / "step-00000001", [ShardSpec("w", (4, 3), torch.randn(4, 3))])
    assert verify_checkpoint(path) == path
    shard = next(path.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    import pytest

    with pytest.raises(ChecksumMismatchError, match="corrupt"):
        verify_checkpoint(path)


@pytest.mark.parametrize("name", ["index.json", "metadata.json"])
def test_damaged_json_is_a_checkpoint_error_naming_the_file(ck2, name):
    from moe_ckpt import CorruptMetadataError, load_metadata

    f = ck2 / name
    f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(CorruptMetadataError, match=rf"{name} is damaged \(JSONDecodeError"):
        load_metadata(ck2)


def test_missing_metadata_is_an_incomplete_checkpoint(ck2):
    from moe_ckpt import load_metadata

    (ck2 / "metadata.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match="has no metadata.json"):
        load_metadata(ck2)
