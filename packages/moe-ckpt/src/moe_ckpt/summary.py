"""inspect_checkpoint: what a checkpoint holds and which layout wrote it, from JSON alone."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from moe_ckpt.geometry import describe
from moe_ckpt.index import read_index
from moe_ckpt.load import load_metadata, resolve
from moe_ckpt.spec import dtype_from_name

DAMAGED = "DAMAGED:"  # how format_checkpoint's text opens when the checkpoint cannot be loaded


def inspect_checkpoint(path: str | Path) -> dict:
    """{"path", "format_version", "world_size", "files", "tensors": {name: {shape, dtype, pieces}}, "metadata",
    "total_bytes"}.

    Reads index.json and metadata.json only, and the shard files' sizes ("file_problems": those missing or of
    another size than recorded); no tensor data.
    """
    path = resolve(path)
    index = read_index(path)
    tensors = {
        name: {"shape": list(t.shape), "dtype": t.dtype,
               "pieces": [f"{p.file}:{describe(p.region)}" for p in t.pieces]}
        for name, t in index.tensors.items()
    }
    total = sum(math.prod(t.shape) * dtype_from_name(t.dtype).itemsize for t in index.tensors.values())
    return {"path": str(path), "format_version": index.format_version, "world_size": index.world_size,
            "files": index.files, "tensors": tensors, "metadata": load_metadata(path), "total_bytes": total,
            "file_problems": file_problems(path, index.files)}


def file_problems(path: Path, files: dict[str, dict]) -> list[str]:
    """The shard files index.json records that are missing or not of their recorded size, one line each (sizes
    only: a checksum reads every byte, which loading and verify_checkpoint do)."""
    problems = []
    for name, record in sorted(files.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} (rank {record['rank']}) is missing")
        elif file.stat().st_size != record["bytes"]:
            problems.append(f"{name} (rank {record['rank']}) has {file.stat().st_size:,} bytes, index.json records "
                            f"{record['bytes']:,}")
    return problems


def format_checkpoint(path: str | Path, *, notes: Callable[[dict], Sequence[str]] | None = None) -> str:
    """inspect_checkpoint as a human-readable table. notes: lines of the caller's own about the checkpoint's
    metadata (what its trainer recorded), shown after the step line; given the metadata read for the table."""
    info = inspect_checkpoint(path)
    meta = info["metadata"]
    lines = [f"checkpoint {info['path']}: {len(info['tensors'])} tensors, "
             f"{info['total_bytes'] / 1e9:.3f} GB, written by {info['world_size']} rank{'s' if info['world_size'] != 1 else ''}, "
             f"format version {info['format_version']}",
             f"layout: {meta.get('layout', '(not recorded)')}",
             f"step: {meta.get('step', '(not recorded)')}",
             *(notes(meta) if notes is not None else ())]
    if info["file_problems"]:  # what the table below would hide: the tensors' data is not all there (first, so that
        # `| head` shows it)
        lines.insert(0, f"{DAMAGED} {'; '.join(info['file_problems'])} (this checkpoint cannot be loaded)")
    width = max((len(n) for n in info["tensors"]), default=0)
    for name, t in info["tensors"].items():
        lines.append(f"  {name:<{width}}  {t['dtype']:<9} {str(tuple(t['shape'])):<20} {len(t['pieces'])} pieces")
    return "\n".join(lines)



def reports_damage(text: str) -> bool:
    """Whether `text`, format_checkpoint's, says the checkpoint cannot be loaded (its first line is the DAMAGED one):
    the test a command makes for its exit status."""
    return text.startswith(DAMAGED)
