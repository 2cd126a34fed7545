"""save_checkpoint: every rank writes the pieces it owns; rank 0 commits.

Protocol (ranks share a file system; `barrier` is the only coordination):
  1. rank 0 removes what failed or killed saves left beside `<path>`
     (step-N.tmp folders ...) and creates `<path>.tmp`             -- barrier
  2. each rank writes shard-RRRRR-of-WWWWW.safetensors (fsynced)
     and a small manifest (its pieces, size, checksum)            -- barrier
  3. rank 0 merges manifests into index.json after metadata.json
     (whose size and checksum index.json records), fsyncs, renames `<path>.tmp` -> `<path>`, moves `latest`,
     applies retention                                             -- barrier
  4. every rank checks the commit happened; if it did not (or rank 0
     failed after it: `latest`, retention), each reads
     the error records in `<path>.tmp`                             -- barrier
     and rank 0 removes `<path>.tmp`
A failure on any rank is written to the tmp directory and every rank still reaches
every barrier, so all ranks raise instead of one hanging. An exception that escapes a
phase (Ctrl-C, a failed barrier) ends the save at once; rank 0 then removes `<path>.tmp`,
and whatever a killed process leaves is removed by the next save (step 1).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import shutil
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from moe_ckpt.errors import CheckpointError
from moe_ckpt.geometry import FlatRange, as_index, describe
from moe_ckpt.index import build_index, manifest_name, shard_file_name
from moe_ckpt.run_dir import (
    INDEX, METADATA, TMP_MARK, apply_retention, is_complete, remove_leftovers, tmp_dir_for, write_latest,
)
from moe_ckpt.shard_file import (
    Checksum, bytes_checksum, fsync_dir, write_json_atomic, write_shard_file, write_text_atomic,
)
from moe_ckpt.spec import ShardSpec, dtype_name, require_shard_spec

Barrier = Callable[[], object]


def save_checkpoint(
    path: str | Path,
    shards: Sequence[ShardSpec],
    metadata: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
    barrier: Barrier | None = None,
    *,
    keep_last_n: int | None = None,
    update_latest: bool = True,
    checksum: str = "crc32",
) -> Path:
    """Save this rank's pieces into checkpoint directory `path` (e.g. run/step-00000100).

    Call on every rank with the same path, metadata (only rank 0's is written) and
    world_size. Returns `path` once the checkpoint is committed on disk.
    keep_last_n: after committing, keep only the newest n checkpoints beside `path`.
    """
    path = Path(path)
    rank, world_size = as_index(rank, "rank"), as_index(world_size, "world_size")  # a rank given as a str is refused
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    if world_size > 1 and barrier is None:
        raise ValueError(f"world_size={world_size} needs a barrier callable (e.g. torch.distributed.barrier)")
    Checksum(checksum)
    # here, on every rank: retention runs after the commit, on rank 0 (as_index: "2" failed on `<`, naming nothing)
    if keep_last_n is not None and as_index(keep_last_n, "keep_last_n") < 1:
        raise ValueError(f"keep_last_n={keep_last_n} must be >= 1 (None keeps every checkpoint)")
    if TMP_MARK in path.name:  # readers take such a folder for a partial save and refuse it
        raise ValueError(f"checkpoint path {path}: its name contains {TMP_MARK!r}, which marks unfinished saves; "
                         f"pick a name without it (e.g. step_dir(run, step))")
    if path.exists() or path.is_symlink():
        raise FileExistsError(f"checkpoint {path} already exists; pick a new directory or delete it")
    barrier = barrier or (lambda: None)
    tmp = tmp_dir_for(path)
    errors: list[BaseException] = []

    def phase(fn: Callable[[], None]) -> None:
        if errors:
            return
        try:
            fn()
        except Exception as e:  # recorded so every rank still reaches every barrier
            errors.append(e)
            _record_error(tmp, rank, e)

    try:
        if rank == 0:
            phase(lambda: _prepare(tmp, metadata))
        barrier()
        phase(lambda: _write_rank(tmp, shards, rank, world_size, checksum))
        barrier()
        if rank == 0:
            phase(lambda: _commit(path, tmp, metadata, world_size, checksum, update_latest, keep_last_n))
        barrier()
        if not is_complete(path):  # the same answer on every rank: the rename happened before the barrier
            if not errors:  # the other ranks' records, read now: after the barrier below they may go
                errors.append(CheckpointError(
                    f"checkpoint {path} was not committed: {_read_errors(tmp) or 'no error recorded'}"))
            barrier()  # every rank has read the error records; the tmp folder may go
            raise errors[0]
        late = _read_errors(tmp)  # committed, then rank 0 failed moving `latest` or applying retention
        if late:
            barrier()  # every rank has read the record; it may go
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise errors[0] if errors else CheckpointError(
                f"checkpoint {path} was committed, then rank 0 failed: {late}")
        if errors:  # committed, then a later step failed on this rank and its record could not be written
            raise errors[0]
    except BaseException:
        if rank == 0 and not is_complete(path):
            shutil.rmtree(tmp, ignore_errors=True)  # abandoned: what survives keeps its .tmp name
        raise
    finally:
        # The error raised has this frame (and `phase`'s, which shares `errors`) on its traceback: kept in `errors`,
        # it would be a cycle holding the barrier and the process group it closes over (see fail_together).
        errors.clear()
    return path


def _prepare(tmp: Path, metadata: dict | None) -> None:
    remove_leftovers(tmp.parent)
    if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):  # not ours: neither followed nor deleted
        what = f"a symbolic link to {os.readlink(tmp)}" if tmp.is_symlink() else "a file"
        raise CheckpointError(f"{tmp} is {what}; the save writes its temporary folder there: move it away")
    if tmp.exists():  # a crashed earlier attempt at the same path, if its name is not step-N
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    fsync_dir(tmp.parent)
    # checked once the folder exists, so that the error record the other ranks read can be written there
    if metadata is not None and not isinstance(metadata, dict):  # metadata.json is it plus the "moe_ckpt" entry
        raise TypeError(f"metadata is a {type(metadata).__name__}, expected a dict (or None)")
    try:  # fail before any rank writes if metadata is not JSON
        json.dumps(metadata or {})
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata is not JSON-serialisable: {e}") from None


def _write_rank(tmp: Path, shards: Sequence[ShardSpec], rank: int, world_size: int, algorithm: str) -> None:
    if not _is_own_dir(tmp):
        raise CheckpointError(f"rank {rank}: {tmp} is not a folder; rank 0 failed to create it "
                              f"({_read_errors(tmp) or 'or the ranks do not share a file system'})")
    failed = _read_errors(tmp)
    if failed:  # rank 0 refused the save while preparing it (or a rank failed already): nothing will be committed
        raise CheckpointError(f"rank {rank}: not writing {tmp.name}: {failed}")
    entries, pieces, declared, seen = [], [], [], {}
    for i, s in enumerate(shards):
        require_shard_spec(s, i)
        s.validate()  # a field changed since construction (e.g. .tensor of another shape) is refused, not committed
        if not s.writer:  # another rank writes it; named so that the commit can check one does
            declared.append({"name": s.name, "shape": list(s.global_shape), "dtype": dtype_name(s.dtype)})
            continue
        key = f"{s.name}{describe(s.region)}"
        if key in seen and seen[key] != s.name:  # e.g. "xflat" rows [0:2] and "x" elements flat[0:2]
            raise ValueError(f"rank {rank}: tensors {seen[key]!r} and {s.name!r} would both be stored under key "
                             f"{key!r} in one shard file; rename one of them")
        if key in seen:
            raise ValueError(f"rank {rank}: piece {key!r} is listed twice")
        seen[key] = s.name
        # a flat range is stored 1-D whatever shape the caller's tensor has: readers slice it along one dim
        entries.append((key, s.tensor.reshape(-1) if isinstance(s.region, FlatRange) else s.tensor))
        pieces.append({"name": s.name, "shape": list(s.global_shape), "dtype": dtype_name(s.dtype),
                       "key": key, **s.region.to_json()})
    fname = shard_file_name(rank, world_size)
    record = write_shard_file(tmp / fname, entries, {"moe_ckpt.pieces": json.dumps(pieces)}, algorithm)
    write_json_atomic(tmp / manifest_name(rank, world_size),
                      {"rank": rank, "file": fname, "bytes": record.nbytes, "checksum": record.checksum,
                       "pieces": pieces, "declared": declared})


def _commit(path: Path, tmp: Path, metadata: dict | None, world_size: int, algorithm: str,
            update_latest: bool, keep_last_n: int | None) -> None:
    failed = _read_errors(tmp)
    if failed:
        raise CheckpointError(f"not committing {path}: {failed}")
    manifests = []
    for r in range(world_size):
        mpath = tmp / manifest_name(r, world_size)
        if not mpath.is_file():
            raise CheckpointError(f"not committing {path}: rank {r} wrote no {mpath.name} "
                                  f"(is world_size={world_size} right, and the file system shared?)")
        manifests.append(json.loads(mpath.read_text()))
    index = build_index(manifests, world_size, algorithm)
    meta = dict(metadata or {})
    meta["moe_ckpt"] = {  # about the writer, for people; the format version is index.json's alone
        "writer_world_size": world_size,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "checksum_algorithm": algorithm,
        "writer": _writer_version(),
    }
    # its bytes as written are checksummed: a value edited later (the step, the sampler's position) fails the read
    written = bytes_checksum(write_json_atomic(tmp / METADATA, meta), algorithm)
    index.metadata_file = {"bytes": written.nbytes, "checksum": written.checksum}
    write_json_atomic(tmp / INDEX, index.to_json())  # last: its presence marks completeness
    for r in range(world_size):
        os.remove(tmp / manifest_name(r, world_size))
    fsync_dir(tmp)
    os.rename(tmp, path)
    try:  # committed: a failure from here on is recorded for every rank to raise (not rank 0's alone)
        fsync_dir(path.parent)
        if update_latest:
            write_latest(path.parent, path)
        if keep_last_n is not None:
            apply_retention(path.parent, keep_last_n)
    except Exception:
        with contextlib.suppress(OSError):  # a folder again, for the error record every rank reads
            tmp.mkdir()
        raise


def _writer_version() -> str:
    try:
        return f"moe-ckpt {importlib.metadata.version('moe-ckpt')}"
    except importlib.metadata.PackageNotFoundError:
        return "moe-ckpt (not installed)"


def _is_own_dir(tmp: Path) -> bool:
    """A real folder: a symlink at the tmp name points at something else, never written through."""
    return tmp.is_dir() and not tmp.is_symlink()


def _record_error(tmp: Path, rank: int, e: BaseException) -> None:
    try:
        if _is_own_dir(tmp):
            # whole or absent: the other ranks read it while this one writes it (a half-written record read as
            # "rank-00000: " with the cause missing, as the error of a save that one rank's metadata failed)
            write_text_atomic(tmp / f"rank-{rank:05d}.error", "".join(traceback.format_exception_only(e)).strip())
    except OSError:
        pass


def _read_errors(tmp: Path) -> str:
    if not _is_own_dir(tmp):
        return ""
    # listed with iterdir, not glob: from Python 3.12 glob drops an error listing the folder (read as no rank having
    # failed, the save went on); 3.11's raised it, naming the folder, as every Python's iterdir does
    records = sorted(p for p in tmp.iterdir() if p.name.startswith("rank-") and p.name.endswith(".error"))
    return "; ".join(f"{p.stem}: {p.read_text()}" for p in records)
