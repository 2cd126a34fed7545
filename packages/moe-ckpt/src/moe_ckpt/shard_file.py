"""One rank's shard file: a standard safetensors file, streamed and checksummed in one pass.

We write the (simple, documented) safetensors layout ourselves instead of calling
`safetensors.torch.save_file` so that (a) the checksum is computed while the bytes go
out, with no second read, (b) no serialised copy of the whole shard is built in
memory, and (c) pieces that are views of one buffer (a ZeRO flat shard) need no
clone. Every file is read back with the safetensors library (`safe_open`).

Layout: u64 little-endian header length N, N bytes of JSON header (padded with
spaces to a multiple of 8), then the raw row-major bytes of each tensor in order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_ckpt.spec import safetensors_code

_CHUNK = 64 << 20  # bytes per write / checksum update
_FLUSH = 256 << 20  # start writeback every this many bytes


class Checksum:
    """Incremental checksum: "crc32" (zlib, ~3 GB/s on one core) or "sha256" (~1.3 GB/s)."""

    ALGORITHMS = ("crc32", "sha256")

    def __init__(self, algorithm: str) -> None:
        if algorithm not in self.ALGORITHMS:
            raise ValueError(f"checksum algorithm {algorithm!r} is not one of {self.ALGORITHMS}")
        self.algorithm = algorithm
        self._crc = 0
        self._sha = hashlib.sha256() if algorithm == "sha256" else None

    def update(self, data: memoryview | bytes) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


@dataclass
class FileRecord:
    nbytes: int
    checksum: str


def _as_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_shard_file(
    path: Path, entries: list[tuple[str, torch.Tensor]], metadata: dict[str, str], algorithm: str
) -> FileRecord:
    """Write `entries` (key, tensor) as a safetensors file at `path`, fsync it, return size and checksum."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key, t in entries:
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": safetensors_code(t.dtype), "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    check = Checksum(algorithm)
    total = 0
    # Three streams overlap: this thread copies bytes into the page cache, one worker
    # checksums the same chunks (in order), another starts writeback with fdatasync
    # every _FLUSH bytes so the final fsync does not write the whole file at once.
    with naming(path), open(path, "wb", buffering=0) as f, _worker() as summer, _worker() as flusher:
        pending_flush = None
        for chunk in _chunks(head, entries):
            summer.submit(check.update, chunk)
            done = 0
            while done < len(chunk):
                done += f.write(chunk[done:])
            if (total + done) // _FLUSH > total // _FLUSH and (pending_flush is None or pending_flush.done()):
                pending_flush = flusher.submit(os.fdatasync, f.fileno())
            total += done
        summer.shutdown(wait=True)
        if pending_flush is not None:
            pending_flush.result()
        os.fsync(f.fileno())
    return FileRecord(total, check.hexdigest())


def _worker() -> ThreadPoolExecutor | _ThisThread:
    """A pool of one thread; or this thread, where none can start: CPython 3.12.0 and 3.12.1 refuse new threads in
    exit hooks (fixed in 3.12.2, gh-113964), where a save left in flight is finished (async_save._settle_all); the
    save failed there with "can't create new thread at interpreter shutdown"."""
    probe = threading.Thread(target=int)
    try:
        probe.start()
    except RuntimeError:
        return _ThisThread()
    probe.join()
    return ThreadPoolExecutor(1)


class _ThisThread:
    """An executor that runs each call as it is submitted, on the caller's thread."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - raised by result(), as a pool's future raises it
            future.set_exception(e)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass

    def __enter__(self) -> _ThisThread:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _chunks(head: bytes, entries: list[tuple[str, torch.Tensor]]) -> Iterator[memoryview]:
    yield memoryview(len(head).to_bytes(8, "little"))
    yield memoryview(head)
    for _, t in entries:
        data = _as_bytes(t)
        for i in range(0, len(data), _CHUNK):
            yield data[i : i + _CHUNK]


def bytes_checksum(data: bytes, algorithm: str) -> FileRecord:
    """Size and checksum of `data`, a small file's whole content (metadata.json), read or written in one piece."""
    check = Checksum(algorithm)
    check.update(data)
    return FileRecord(len(data), check.hexdigest())


def file_checksum(path: Path, algorithm: str) -> FileRecord:
    """Size and checksum of the file at `path`, read in chunks."""
    check = Checksum(algorithm)
    total = 0
    with naming(path), open(path, "rb", buffering=0) as f:  # a failing fstat or read names no file of its own
        # No bigger than the file: a zeroed 64 MB buffer costs ~35 ms, which dominated verifying small shards.
        buf = bytearray(min(_CHUNK, max(1, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while n := f.readinto(buf):
            check.update(view[:n])
            total += n
    return FileRecord(total, check.hexdigest())


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError naming no file, as a write, fsync or close of a file descriptor raises ("[Errno 28] No space left
    on device"), is raised again naming `path`: which disk filled, which file failed to reach it."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror, str(path)).with_traceback(e.__traceback__) from None


def fsync_dir(path: Path) -> None:
    """Make a rename / create inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    with naming(path):
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json_atomic(path: Path, obj: object) -> bytes:
    """Write JSON to a temp name beside `path`, fsync, then os.replace onto `path`; returns the bytes written, the
    file's exact content (what a checksum of it must cover)."""
    data = json.dumps(obj, indent=1).encode()  # ASCII (json escapes the rest): the same bytes under any locale
    write_text_atomic(path, data)
    return data


def write_text_atomic(path: Path, text: str | bytes, tmp: Path | None = None) -> None:
    """Write text (or bytes, as they are) to a temp name beside `path` (`tmp`, by default .NAME.tmp-PID), fsync,
    then os.replace onto `path`: a reader sees the whole text under `path` or no file (open + write would show it
    empty or cut to another process in between). The temp file is removed if any of it fails."""
    tmp = tmp or path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with naming(tmp), open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
