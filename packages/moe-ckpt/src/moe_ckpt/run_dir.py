"""A run directory of checkpoints: the `latest` pointer, discovery and retention.

    run/
      step-00000100/      committed: index.json present, named exactly as step_dir names it
      step-00000200.tmp/  a save in progress or a crashed one: always ignored, removed by the next save
      latest              text file holding "step-00000100", replaced atomically
      step-00000100.bak/  any other name (a user's copy, a folder of notes): never listed, resumed or deleted

A checkpoint directory is only ever renamed into place after its index.json (written
last) is fsynced, so "has index.json and no .tmp in its name" means complete. One save at a
time per run directory: a save starts by removing what earlier failed or killed ones left.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path

from moe_ckpt.errors import CheckpointError
from moe_ckpt.geometry import as_index
from moe_ckpt.shard_file import fsync_dir, naming, write_text_atomic

INDEX = "index.json"
METADATA = "metadata.json"
LATEST = "latest"
TMP_MARK = ".tmp"


def step_dir(root: str | Path, step: int) -> Path:
    """The conventional checkpoint directory for `step`: root/step-00000123."""
    try:  # any integer (numpy's, a 0-dim integer tensor's) but a bool
        number = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        number = None
    if number is None or number < 0:  # step-0000-1 would be written, then never found: find_latest lists step-<digits>
        raise ValueError(f"step={step!r}: expected an integer >= 0")
    return Path(root) / f"step-{number:08d}"


_STEP_NAME = re.compile(r"step-(\d{8,})")


def step_of(path: str | Path) -> int | None:
    """The inverse of step_dir: the step of a folder named like root/step-00000123 (123), else None.

    Only the exact names step_dir makes count ("step-1", "step-00000001.tmp" are None)."""
    name = Path(path).name
    m = _STEP_NAME.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(".", step).name == name else None


def tmp_dir_for(path: Path) -> Path:
    return path.with_name(path.name + TMP_MARK)


def is_complete(path: Path) -> bool:
    return TMP_MARK not in path.name and (path / INDEX).is_file()


def list_checkpoints(root: str | Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest step first.

    Only real folders named as step_dir names them: a copy such as step-00000003.bak or a folder
    backup-before-lr-change holds an index.json too, but is the user's (retention never deletes
    it, find_latest never returns it). So is a symbolic link, even one named step-00000003: a save
    never makes one, and one that points into another run must neither be resumed as this run's
    step nor be deleted (or renamed) by this run's retention."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir()
             if (step := step_of(p)) is not None and not p.is_symlink() and p.is_dir() and is_complete(p)]
    return [p for _, p in sorted(found)]


def _pointer_text(root: Path) -> str | None:
    """What root/latest holds, stripped, or None if there is no pointer."""
    try:
        with naming(root / LATEST):  # an I/O error reading it names the pointer
            return (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None


def _folder_in_run(root: Path, name: str | None) -> Path | None:
    """root/name when `name` names a folder directly inside the run (a save writes nothing else), else None."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or len(name.encode()) > 255:
        return None  # over 255 bytes: no file system names a folder so (stat raised ENAMETOOLONG, helper 175)
    return root / name


def read_latest(root: Path) -> Path | None:
    return _folder_in_run(root, _pointer_text(root))


def find_latest(root: str | Path) -> Path | None:
    """Resolve a run directory to its latest committed checkpoint, or None if it has none.

    The committed checkpoint of the highest step (list_checkpoints). `latest` names it after every
    save, but a crash between a checkpoint's rename into place and the pointer update leaves the
    pointer one behind: the newer complete checkpoint wins (to roll back, move newer checkpoints away).
    Partial `.tmp` directories are never returned. A pointer naming no committed checkpoint of the run (its
    folder deleted or damaged since) is warned about, naming both: the run then resolves to an older step.
    """
    root = Path(root)
    found = list_checkpoints(root)
    newest = found[-1] if found else None
    taken = (f"resolving to {newest.name}, the newest one there is" if newest is not None
             else "there is no committed checkpoint to resolve to")  # what either warning below says happens
    try:
        text = _pointer_text(root) if root.is_dir() else None
    except (UnicodeDecodeError, IsADirectoryError):  # a damaged pointer, which resolution does not need (I/O raises)
        warnings.warn(f"{root / LATEST} cannot be read as a pointer (not UTF-8 text, or a folder): ignored; {taken}",
                      stacklevel=2)
        text = None
    pointer = _folder_in_run(root, text)
    if text is not None and pointer is None:  # a save writes one folder name; this was written by hand
        warnings.warn(f"{root / LATEST} holds {text!r}, not the name of a folder inside the run (a path, empty, '.', "
                      f"'..' or over 255 bytes; a run resolves only to its own checkpoints): ignored; {taken}",
                      stacklevel=2)
    if pointer is not None and pointer not in found:
        if pointer.is_symlink():  # a save never makes one (list_checkpoints)
            why = f"a symbolic link, which runs never resolve to ({taken})"
        elif step_of(pointer) is None and pointer.is_dir() and is_complete(pointer):  # save_checkpoint(run/final)
            why = f"a committed checkpoint, but runs resolve only to folders named as step_dir names them ({taken})"
        else:
            why = f"which is not a committed checkpoint of this run (deleted, moved, or its index.json lost): {taken}"
        warnings.warn(f"{root / LATEST} names {pointer.name}, {why}", stacklevel=2)
    return newest


def write_latest(root: Path, checkpoint: Path) -> None:
    """Point root/latest at `checkpoint` (a temp file renamed over the old pointer)."""
    # a temp name remove_leftovers knows (_LATEST_TMP), should the removal on failure fail too
    write_text_atomic(root / LATEST, checkpoint.name + "\n", tmp=root / f".{LATEST}.tmp-{uuid.uuid4().hex}")
    fsync_dir(root)


_DELETING = re.compile(rf"{re.escape(TMP_MARK)}-delete-[0-9a-f]{{8}}")
_LATEST_TMP = re.compile(rf"\.{LATEST}\.tmp-[0-9a-f]{{32}}")


def _is_leftover(p: Path) -> bool:
    """A name only moe-ckpt makes: step-N.tmp (a save), step-N.tmp-delete-XXXXXXXX (retention), .latest.tmp-*."""
    if p.is_symlink():
        return False
    if _LATEST_TMP.fullmatch(p.name):
        return p.is_file()
    base, mark, rest = p.name.partition(TMP_MARK)
    ours = mark and step_of(base) is not None and (rest == "" or _DELETING.fullmatch(mark + rest))
    return bool(ours) and p.is_dir()


def remove_leftovers(root: Path) -> list[Path]:
    """Remove what failed or killed saves left in run directory `root`; returns what was removed.

    Only names moe-ckpt itself makes, never a symlink, never a committed checkpoint (those have
    no ".tmp" in their name). Not safe while a save into `root` is in flight: save_checkpoint
    calls it on rank 0 before its own save starts (one save at a time per run directory)."""
    removed = [p for p in sorted(root.iterdir()) if _is_leftover(p)] if root.is_dir() else []
    for p in removed:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)  # what survives still has ".tmp" in its name: ignored
        else:
            p.unlink(missing_ok=True)
    return removed


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that a crash half-way never leaves something that looks complete."""
    if path.is_symlink() or not path.is_dir():  # never through a link, never a link's target
        raise CheckpointError(f"{path} is not a checkpoint folder (a symbolic link or a file); not deleting it")
    doomed = path.with_name(f"{path.name}{TMP_MARK}-delete-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def apply_retention(root: str | Path, keep_last_n: int) -> list[Path]:
    """Remove all but the last `keep_last_n` committed checkpoints (never the `latest` target, never a
    folder list_checkpoints does not list)."""
    keep_last_n = as_index(keep_last_n, "keep_last_n")  # "2" or None failed on `<`, naming neither
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n={keep_last_n} must be >= 1")
    root = Path(root)
    latest = read_latest(root)
    found = list_checkpoints(root)
    doomed = [p for p in found[: max(0, len(found) - keep_last_n)] if p != latest]
    for p in doomed:
        remove_checkpoint(p)
    return doomed
