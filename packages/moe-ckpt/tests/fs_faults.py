"""A fault injector for file-system operations (QA 105): wraps, in process, the calls a checkpoint save makes and
makes the i-th one fail as the real call would. Used by moe-ckpt's tests/test_qa105.py and moe-train's (which loads
this file by path: it imports nothing from the tests).

Faults(root, reads=True) also counts (and fails) what a load calls (QA 109): os.stat / os.lstat (Path.exists,
is_file, is_dir, is_symlink, stat), os.fstat of a file it opened, read / readinto / readline of a file opened to
read, and safetensors' safe_open as moe_ckpt.load calls it (it opens and maps the file in Rust: its fault is raised
at the call, as safetensors raises an I/O error, an OSError with neither errno nor file name). Reads of a mapped
shard's bytes (get_slice, get_tensor) are page faults in Rust, not calls: an I/O error there is SIGBUS, which
no injector in process can raise."""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import shutil
import sys
import threading
from pathlib import Path


LISTING = "os.scandir" if sys.version_info >= (3, 13) else "os.listdir"  # what Path.iterdir calls to list a folder


class Interrupted(BaseException):
    """Not an Exception, as KeyboardInterrupt: what a Ctrl-C landing inside a file-system call raises."""


_REAL = {"open": builtins.open, "os.open": os.open, "os.close": os.close, "os.fsync": os.fsync,
         "os.fdatasync": os.fdatasync, "os.replace": os.replace, "os.rename": os.rename, "os.remove": os.remove,
         "os.unlink": os.unlink, "os.rmdir": os.rmdir, "os.mkdir": os.mkdir, "os.listdir": os.listdir,
         "os.scandir": os.scandir, "os.stat": os.stat, "os.lstat": os.lstat, "os.fstat": os.fstat,
         "shutil.rmtree": shutil.rmtree}


class Faults:
    """Counts the file-system operations on paths under `root` and makes operation `fail_at` (1-based) fail.

    kind: "ENOSPC" or "EIO" (an OSError as the real call raises it) or "interrupt" (Interrupted).
    reads: also count the calls that only read (stat, fstat, file reads, safe_open); off, a save's count is QA 105's."""

    def __init__(self, root: Path, reads: bool = False) -> None:
        self.root = str(root)
        self.reads = reads
        self.fail_at: int | None = None
        self.kind = "ENOSPC"
        self.ops: list[tuple[str, str]] = []  # (operation, path relative to root)
        self.failed: tuple[str, str] | None = None  # (operation, absolute path) of the fault raised
        self._fds: dict[int, str] = {}
        self._quiet = threading.local()  # inside a counted rmtree: its own calls are not operations

    def _ours(self, path) -> str | None:
        if isinstance(path, int) or getattr(self._quiet, "on", False):
            return None
        p = os.path.abspath(os.fsdecode(path))
        return p if p == self.root or p.startswith(self.root + os.sep) else None

    def _hit(self, op: str, path: str, names_path: bool = True, path2: str | None = None,
             rust: bool = False) -> bool:
        """Count one operation; raise its fault if it is the one to fail. True: a fault the caller swallows."""
        self.ops.append((op, os.path.relpath(path, self.root)))
        if len(self.ops) != self.fail_at:
            return False
        self.failed = (op, path)
        if op == "shutil.rmtree(ignore_errors)":
            return True
        if self.kind == "interrupt":
            raise Interrupted(f"interrupted in {op}")
        code = errno.ENOSPC if self.kind == "ENOSPC" else errno.EIO
        if rust:  # safetensors turns Rust's io::Error into an OSError of its message alone
            raise OSError(f"{os.strerror(code)} (os error {code})")
        if not names_path:
            raise OSError(code, os.strerror(code))
        raise OSError(code, os.strerror(code), path, None, path2) if path2 else OSError(code, os.strerror(code), path)

    def _read_hit(self, op: str, path: str) -> None:
        """A read of a file's contents: an OSError naming no file, as the real read raises it."""
        if self.reads and not getattr(self._quiet, "on", False):
            self._hit(op, path, names_path=False)

    @contextlib.contextmanager
    def active(self, monkeypatch, fail_at: int | None = None, kind: str = "ENOSPC"):
        self.fail_at, self.kind, self.ops, self.failed = fail_at, kind, [], None
        faults = self

        class File:
            def __init__(self, f, path, writes):
                self._f, self._path, self._writes = f, path, writes

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

            def __iter__(self):
                return iter(self._f)

            def read(self, *a):
                faults._read_hit("file.read", self._path)
                return self._f.read(*a)

            def readinto(self, buf):
                faults._read_hit("file.readinto", self._path)
                return self._f.readinto(buf)

            def readline(self, *a):
                faults._read_hit("file.readline", self._path)
                return self._f.readline(*a)

            def write(self, data):
                faults._hit("file.write", self._path, names_path=False)
                return self._f.write(data)

            def flush(self):
                if self._writes:
                    faults._hit("file.flush", self._path, names_path=False)
                return self._f.flush()

            def close(self):  # closing a file opened to read loses nothing: not an operation that fails
                if self._f.closed:
                    return None
                faults._fds.pop(self._f.fileno(), None)  # the number goes back to the system: no longer ours
                try:
                    if self._writes:
                        faults._hit("file.close", self._path, names_path=False)
                finally:
                    self._f.close()

        def wrapped_open(file, mode="r", *a, **k):
            p = faults._ours(file)
            if p is None:
                return _REAL["open"](file, mode, *a, **k)
            faults._hit(f"open({mode})", p)
            f = _REAL["open"](file, mode, *a, **k)
            faults._fds[f.fileno()] = p
            return File(f, p, any(c in mode for c in "wax+"))

        def path_op(name):
            real = _REAL[name]

            def op(path, *a, **k):
                p = faults._ours(path)
                if p is not None:
                    faults._hit(name, p)
                return real(path, *a, **k)
            return op

        def stat_op(name):
            real = _REAL[name]

            def op(path, *a, **k):
                p = faults._ours(path) if "dir_fd" not in k else None
                if p is not None:
                    faults._hit(name if k.get("follow_symlinks", True) else "os.lstat", p)
                return real(path, *a, **k)
            return op

        def wrapped_safe_open(filename, *a, **k):
            p = faults._ours(filename)
            if p is not None:
                faults._hit("safe_open", p, rust=True)
            return real_safe_open(filename, *a, **k)

        def two_path_op(name):
            real = _REAL[name]

            def op(src, dst, *a, **k):
                p = faults._ours(src)
                if p is not None:
                    faults._hit(name, p, path2=os.fspath(dst))
                return real(src, dst, *a, **k)
            return op

        def fd_op(name):
            real = _REAL[name]

            def op(fd, *a, **k):
                p = faults._fds.get(fd) if not getattr(faults._quiet, "on", False) else None
                if p is not None:
                    faults._hit(name, p, names_path=False)
                return real(fd, *a, **k)
            return op

        def wrapped_os_open(path, flags, *a, **k):
            p = faults._ours(path) if "dir_fd" not in k else None
            if p is not None:
                faults._hit("os.open", p)
            fd = _REAL["os.open"](path, flags, *a, **k)
            if p is not None:
                faults._fds[fd] = p
            return fd

        def wrapped_close(fd):
            try:
                fd_op("os.close")(fd)
            finally:
                faults._fds.pop(fd, None)

        def wrapped_rmtree(path, ignore_errors=False, *a, **k):
            p = faults._ours(path)
            if p is not None and faults._hit("shutil.rmtree(ignore_errors)" if ignore_errors else "shutil.rmtree", p):
                return None  # a failing rmtree told to ignore errors: nothing removed, no error
            faults._quiet.on = True
            try:
                return _REAL["shutil.rmtree"](path, ignore_errors, *a, **k)
            finally:
                faults._quiet.on = False

        monkeypatch.setattr(builtins, "open", wrapped_open)
        monkeypatch.setattr(io, "open", wrapped_open)
        monkeypatch.setattr(os, "open", wrapped_os_open)
        monkeypatch.setattr(os, "close", wrapped_close)
        for name in ("os.fsync", "os.fdatasync"):
            monkeypatch.setattr(os, name[3:], fd_op(name))
        for name in ("os.replace", "os.rename"):
            monkeypatch.setattr(os, name[3:], two_path_op(name))
        for name in ("os.remove", "os.unlink", "os.rmdir", "os.mkdir", "os.listdir", "os.scandir"):
            monkeypatch.setattr(os, name[3:], path_op(name))
        monkeypatch.setattr(shutil, "rmtree", wrapped_rmtree)
        if self.reads:
            import moe_ckpt.load

            real_safe_open = moe_ckpt.load.safe_open
            for name in ("os.stat", "os.lstat"):
                monkeypatch.setattr(os, name[3:], stat_op(name))
            monkeypatch.setattr(os, "fstat", fd_op("os.fstat"))
            monkeypatch.setattr(moe_ckpt.load, "safe_open", wrapped_safe_open)
        try:
            yield self
        finally:
            monkeypatch.undo()
            self._fds.clear()


@contextlib.contextmanager
def memory_folder(fallback: Path, prefix: str):
    """A fresh folder in memory (tmpfs, /dev/shm) where there is one, else `fallback`: a save makes ~8 fsyncs, ~20 ms
    each on disk, and the fault loops make hundreds of saves. Removed afterwards."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield fallback
        return
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix, dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
