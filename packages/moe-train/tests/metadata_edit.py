"""Tests that stand in for a checkpoint of another release or another run edit its metadata.json: since moe-ckpt
0.19 index.json records the file's size and checksum and a read refuses other bytes, so the edit re-records them,
as a save of that metadata would have."""

from __future__ import annotations

import json
from pathlib import Path

from moe_ckpt.shard_file import bytes_checksum


def rewrite_metadata(meta_file: Path, meta: dict) -> None:
    """metadata.json of a checkpoint folder replaced by `meta`, with index.json's record of it to match."""
    data = json.dumps(meta, indent=1).encode()
    meta_file.write_bytes(data)
    index_file = meta_file.parent / "index.json"
    index = json.loads(index_file.read_text())
    record = bytes_checksum(data, index["checksum_algorithm"])
    index["metadata_file"] = {"bytes": record.nbytes, "checksum": record.checksum}
    index_file.write_text(json.dumps(index, indent=1))
