"""Write a folder whole beside its target, then rename it into place: a reader of the target sees the old
folder or the new one, never a mix (a new config.json beside old weights), and a failure leaves the old one.

    write_folder_whole("out/hf", lambda tmp: write_files_into(tmp), check=refuse_foreign_files, what="export")

The folder is written as `.NAME.tmp-HOST-PID-XXXXXXXX` beside the target; a previous target is moved aside to
`.NAME.old-HOST-PID-XXXXXXXX` for the final rename and deleted after it. What killed runs left behind is
removed (or, for a moved-aside target whose replacement never arrived, restored) by the next run to the same
target (`_clean_leftovers`). Used by the Hugging Face export (moe_ckpt.hf) and moe-train's import-hf.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import stat
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from safetensors import SafetensorError

from moe_ckpt.hf.refusals import HFConversionError

T = TypeVar("T")


class FolderWriteError(OSError):
    """Writing the new folder failed on a full disk or a file-size limit, or with an error that names no file (inside
    safetensors' writer: "I/O error: File too large"); this one names the target. The target is as it was."""


# a full disk, a quota, a file-size limit: whatever file an error of these names (shutil.copyfile names its source),
# it is the new folder that could not be written
_NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def write_folder_whole(out_dir: str | Path, write: Callable[[Path], T], *,
                       check: Callable[[Path], None] | None = None, what: str = "export") -> T:
    """Run `write(tmp)` on a new empty folder beside `out_dir`, then rename it to `out_dir`, replacing a previous
    one only once the new one is complete; returns what `write` returned. On any failure `out_dir` is as it was
    and the temporary folder is removed.

    check(final): refuses a target that must not be replaced (raise), after leftovers of killed runs are handled.
    A link to a folder is written through: the folder it points to is replaced (beside it, on its file system),
    and the link stays. what: "export" or "import", for warnings."""
    final = Path(os.path.realpath(out_dir)) if Path(out_dir).is_symlink() else Path(out_dir)
    _clean_leftovers(final, what)
    if final.is_dir() and os.path.samefile(final, os.curdir):
        # '.' cannot be renamed (EBUSY); the same folder by its path is renamed aside and deleted, leaving this process
        # (and a shell in it) in a deleted folder that os.getcwd() no longer finds.
        raise HFConversionError(
            f"out_dir={str(final)!r} is the current directory ({os.getcwd()}): the {what} renames a new folder into "
            "out_dir's place, which would leave this process in a deleted folder; run from another directory")
    if check is not None:
        check(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _beside(final, "tmp")
    tmp.mkdir()
    try:
        try:
            result = write(tmp)
        except (OSError, SafetensorError) as e:
            if isinstance(e, OSError) and e.filename is not None and e.errno not in _NO_ROOM:  # names its file
                raise
            raise FolderWriteError(f"the {what} into {str(final)!r} stopped on {type(e).__name__}: {e} (while its "
                                   f"new folder {tmp.name} was being written beside it; {str(final)!r} is as it was, "
                                   "and the partial folder is removed)") from e
        _give_files_the_mode_of_a_new_file(tmp)
        _replace(final, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _give_files_the_mode_of_a_new_file(folder: Path) -> None:
    """Every file written into `folder` gets the mode a file made with open() gets there (0o644 under umask 022):
    safetensors >= 0.8.1 writes through a temporary file created 0o600, so model.safetensors alone was readable
    by its owner only (another user, or a container running as one, could not load the export)."""
    probe = folder / ".mode-probe"
    probe.touch()
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    for p in folder.iterdir():
        if p.is_file() and not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) != mode:
            os.chmod(p, mode)


def _beside(final: Path, kind: str) -> Path:
    """`.NAME.tmp-HOST-PID-XXXXXXXX` (the folder being written) or `.NAME.old-HOST-PID-XXXXXXXX` (the previous
    folder, moved aside): hidden, beside `final`, naming the host and process that own it."""
    return final.parent / f".{final.name}.{kind}-{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _host_tag() -> str:
    """This host's name as `_beside` writes it: a pid means something only on the host that wrote it (on a
    shared file system another host may run a live process with the same pid)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "unknown-host"


def _leftover_pattern(final: Path) -> re.Pattern[str]:
    """The names `_beside` makes for `final`, and those of moe-ckpt 0.5.0 (no host) and <= 0.4.1 (no pid)."""
    return re.compile(rf"\.{re.escape(final.name)}\.(tmp|old)-(?:(?:([A-Za-z0-9._-]+)-)?([1-9][0-9]*)-)?[0-9a-f]{{8}}")


def _running(pid: int) -> bool:
    if pid == os.getpid():  # another run in this process (a thread), or ours: not a leftover
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


def _clean_leftovers(final: Path, what: str) -> None:
    """Remove what killed runs (`what`: "export" or "import") to `final` left beside it: `.NAME.tmp-*` folders (a
    partial write) and `.NAME.old-*` folders (the folder before it, moved aside). Only real folders with exactly
    the names `_beside` makes (or made without a host, moe-ckpt 0.5.0, or without a pid, up to 0.4.1), and only
    when they were made on this host by a process that is not running; those of another host are left alone
    with a warning (that run may be going on: only its host can tell). When `final` is missing and an `.old-*`
    folder is there, a run was stopped between its two renames: the previous folder is renamed back to `final`
    (the newest one if several), with a warning, so that it is kept if this run fails too and replaced like any
    previous folder if it succeeds."""
    if not final.parent.is_dir():
        return
    pattern, host, tmp, old, foreign = _leftover_pattern(final), _host_tag(), [], [], []
    for p in final.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m is None or p.is_symlink() or not p.is_dir():
            continue
        if m[2] is not None and m[2] != host:
            foreign.append(p.name)
        elif m[3] is None or not _running(int(m[3])):
            (tmp if m[1] == "tmp" else old).append(p)
    if foreign:
        warnings.warn(
            f"{what} to {str(final)!r}: left {', '.join(sorted(foreign))} beside it alone: made by an {what} on "
            f"another host (this is {host}), which may still be running; delete them once it is not",
            UserWarning, stacklevel=4)
    if old and not os.path.lexists(final):
        keep = max(old, key=lambda p: p.stat().st_mtime)
        os.rename(keep, final)
        old.remove(keep)
        warnings.warn(
            f"{what} to {str(final)!r}: out_dir was missing and {keep.name} beside it held the previous {what}, "
            f"moved aside by an {what} that was stopped before it moved its new folder in; restored it to "
            f"{final.name} (this {what} replaces it as usual)", UserWarning, stacklevel=4)
    for p in tmp + old:
        shutil.rmtree(p, ignore_errors=True)


def _replace(final: Path, new: Path) -> None:
    """Rename `new` to `final`; a previous folder at `final` is moved aside first and deleted after, or moved
    back when `new` cannot be renamed in (final is never left missing by a failure this process sees)."""
    old = None
    if final.exists():
        old = _beside(final, "old")
        os.rename(final, old)
    try:
        os.rename(new, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
