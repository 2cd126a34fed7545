"""QA 148: bugs a mutation audit (review helper 161) planted in moe-ckpt that no test caught. The code was right; each
test here passes on it and fails on the planted bug:
1. file_checksum hashing the whole read buffer instead of the bytes read: every test file was smaller than one 64 MiB
   read, so a shard past 64 MiB (not a multiple of it) would fail verification on intact data;
2. retention without `max(0, ...)`: with fewer checkpoints than keep_last_n the slice index goes negative and deletes
   checkpoints the user asked to keep (only keep_last_n=2 with more saves was tested);
3. retention without the `latest` guard: the normal save flow always points latest at the newest checkpoint, so the
   guard never fired in a test (it does after saves with update_latest=False, or a direct apply_retention)."""

from __future__ import annotations

import hashlib
import zlib

import torch

import moe_ckpt.shard_file as shard_file
from moe_ckpt import ShardSpec, apply_retention, list_checkpoints, save_checkpoint, step_dir
from moe_ckpt.run_dir import write_latest


def test_file_checksum_of_a_file_longer_than_one_read_covers_only_the_bytes_read(tmp_path, monkeypatch):
    data = bytes(range(256)) * 3 + b"xyz"  # 771 bytes: reads of 64 leave a short last one after a full one
    path = tmp_path / "f"
    path.write_bytes(data)
    monkeypatch.setattr(shard_file, "_CHUNK", 64)
    crc = shard_file.file_checksum(path, "crc32")
    assert crc.checksum == f"{zlib.crc32(data):08x}" and crc.nbytes == len(data)
    assert shard_file.file_checksum(path, "sha256").checksum == hashlib.sha256(data).hexdigest()


def _save(root, step: int, **kw) -> None:
    save_checkpoint(step_dir(root, step), [ShardSpec("x", (3,), torch.full((3,), float(step)))], {"step": step}, **kw)


def _names(root) -> list[str]:
    return [p.name for p in list_checkpoints(root)]


def test_retention_keeps_every_checkpoint_while_there_are_fewer_than_keep_last_n(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last_n=5)
    assert _names(tmp_path) == ["step-00000001", "step-00000002", "step-00000003"]
    assert apply_retention(tmp_path, 4) == [] and apply_retention(tmp_path, 3) == []
    assert len(_names(tmp_path)) == 3


def test_retention_never_deletes_the_checkpoint_latest_names(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    write_latest(tmp_path, step_dir(tmp_path, 1))  # as after saves made with update_latest=False
    doomed = apply_retention(tmp_path, 1)
    assert doomed == [step_dir(tmp_path, 2)]
    assert _names(tmp_path) == ["step-00000001", "step-00000003"]


def test_a_save_with_update_latest_false_keeps_the_older_latest_through_retention(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2, update_latest=False, keep_last_n=1)
    assert _names(tmp_path) == ["step-00000001", "step-00000002"]  # step 1 is latest's target
