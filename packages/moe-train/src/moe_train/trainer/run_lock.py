"""One job per run folder: rank 0 holds an exclusive lock on `<run_dir>/.lock` while the job runs.

Two jobs training into one run folder would delete each other's in-flight checkpoint saves or,
saving the same step, commit a checkpoint whose shard files the other job then overwrites (the
ranks of a save share only a barrier and the file system, so moe-ckpt cannot tell its folder from
another job's). The lock is an advisory `flock` on an open file: the kernel drops it when the
holding process exits, however it exits, so a killed job never leaves a stale lock behind. The
file itself stays (removing it after the lock is dropped races with a job that has just opened it;
only a folder this job created and left with nothing but the lock file goes, unlinked while still
held); it holds the host, pid and start time of the job that last took it, for the error message.
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

from moe_train.config import ConfigError

LOCK_NAME = ".lock"


class RunFolderBusyError(ConfigError):
    """Another live job holds the run folder's lock."""


class RunFolderLock:
    """An exclusive lock on `run_dir`, taken at construction (the folder is created if missing);
    RunFolderBusyError, naming the folder and the job that holds it, if another job does."""

    def __init__(self, run_dir: str | Path):
        import fcntl

        self.path = Path(run_dir) / LOCK_NAME
        self.created_folder = not self.path.parent.exists()  # this job made the run folder (release may remove it)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a+")  # noqa: SIM115 - held open for the job's life: the lock lives with it
        except OSError as e:  # another user's folder, a read-only mount, a file in the path: one line naming the field
            # (a file in the path, a link to nothing and a path the system cannot hold, such as /proc/x, named only
            # the path before 0.27.27, and a link to nothing said "File exists"; review helper 174)
            why = {NotADirectoryError: "; a part of the path is a file, not a folder",
                   FileExistsError: "; a file, or a link to nothing, is in the way",
                   FileNotFoundError: "; a folder of the path cannot be made there"}.get(type(e), "")
            raise ConfigError(f"train.run_dir={str(run_dir)!r}: cannot create or write it ({e.strerror or e}: "
                              f"{e.filename}{why}); expected a folder this job can write, or a path to create "
                              "one") from None
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "a job that did not record itself"
            self._file.close()
            raise RunFolderBusyError(
                f"train.run_dir={str(run_dir)!r} is in use by another job ({holder}): two jobs in one run folder "
                "delete or overwrite each other's checkpoints; wait for it to finish, stop it, or give this run "
                "another train.run_dir"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._file.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n")
        self._file.flush()

    def release(self) -> None:
        """Drop the lock (closing the file drops it); idempotent. A run folder this job created and left holding only
        the lock file (a run refused before it wrote anything) is removed: the file is unlinked while the lock is
        still held, so a job that opened it meanwhile fails to lock it instead of sharing the folder."""
        if self._file.closed:
            return
        folder = self.path.parent
        unused = self.created_folder and sorted(os.listdir(folder)) == [LOCK_NAME]
        if unused:
            os.unlink(self.path)
        self._file.close()
        if unused:
            try:
                folder.rmdir()
            except OSError:  # another job has just made something there: the folder is its now
                pass
