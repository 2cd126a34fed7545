"""AsyncCheckpointer: snapshot to host memory on the caller's thread, write on a background one.

The barrier handed to `save` runs on the background thread. With torch.distributed,
give it a group of its own (e.g. `g = dist.new_group(backend="gloo", timeout=...)`,
`barrier=lambda: dist.barrier(group=g)`) so it never interleaves with the training
loop's collectives on the default group; its timeout bounds how long a save waits for a
rank that is gone.

Use it as a context manager around the training loop: leaving the block, normally or by an
exception (Ctrl-C included), waits for the save in flight, which then either commits or fails
and removes its tmp folder (save_checkpoint does). On the exception path a save error is added
as a note to the exception already leaving, never raised over it. The save's barriers run on the
background threads of all ranks, not on the training loop's threads, so a rank whose loop raised
still meets the others there: waiting is bounded by the barrier group's timeout.

A save still in flight when the interpreter exits (no `with` block, no `wait()`) is waited for at exit, with a
line on stderr saying so and one saying how it ended, instead of its daemon thread being killed and the save
lost without a word. Waiting, not only warning, because every rank that exits runs the same wait: the save's
barriers then meet on the background threads exactly as they do when a `with` block is left, bounded by the
barrier group's timeout when a peer is gone (Ctrl-C abandons the wait; the next save removes the tmp folder).
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_ckpt.geometry import describe
from moe_ckpt.save import save_checkpoint
from moe_ckpt.spec import ShardSpec, require_shard_spec


@dataclass
class SaveStats:
    path: Path
    bytes: int  # bytes this rank wrote
    stall_s: float  # time `save` blocked the caller: waiting on the previous save + the snapshot
    snapshot_s: float  # of which the device/host -> host copy
    write_s: float  # background time: files, fsync, commit


class AsyncCheckpointer:
    """One save in flight at a time; a new `save` first waits for the previous one.

    reuse_buffers: keep the host snapshot buffers (pinned when the source is on CUDA)
    between saves so later snapshots allocate nothing; costs one host copy of the
    rank's state for the life of the object.
    """

    def __init__(self, reuse_buffers: bool = True) -> None:
        self.reuse_buffers = reuse_buffers
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: SaveStats | None = None
        self.last_stats: SaveStats | None = None

    def save(
        self,
        path: str | Path,
        shards: Sequence[ShardSpec],
        metadata: dict | None = None,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], object] | None = None,
        **save_kwargs,
    ) -> None:
        """Snapshot `shards` now and return; the checkpoint is written in the background.

        Raises the previous background save's error, if it failed. A snapshot that fails here (metadata
        that is not JSON, a tensor that cannot be copied) fails this save on every rank, raised by wait(): the
        other ranks' saves are waiting for this one at their barriers. save_kwargs go to save_checkpoint
        (keep_last_n, update_latest, checksum).
        """
        t0 = time.perf_counter()
        self.wait()
        t1 = t0
        try:
            meta = json.loads(json.dumps(metadata or {}))  # a private copy, validated as JSON now
            t1 = time.perf_counter()
            snap = self._snapshot(shards)
            nbytes = sum(s.nbytes for s in snap if s.writer)
        except Exception as e:  # noqa: BLE001 - raising here would leave the peers' saves waiting at a barrier
            meta, snap, nbytes = None, _Failed(e), 0  # the save runs, fails writing, and every rank raises at wait()
        t2 = time.perf_counter()
        stats = SaveStats(Path(path), nbytes, t2 - t0, t2 - t1, 0.0)
        self._pending = stats

        def run() -> None:
            start = time.perf_counter()
            try:
                save_checkpoint(path, snap, meta, rank, world_size, barrier, **save_kwargs)
            except BaseException as e:  # surfaced by the next wait() / save()
                self._error = e
            finally:
                stats.write_s = time.perf_counter() - start
                if isinstance(snap, _Failed):
                    snap.error = None  # the save is over: no cycle through its frames (see _Failed)

        self._thread = threading.Thread(target=run, name="moe-ckpt-async-save", daemon=True)
        _settle_at_exit(self)
        self._thread.start()

    def wait(self) -> SaveStats | None:
        """Block until the save in flight (if any) is committed; raise its error if it failed.
        last_stats: the last save that committed (a failed save's stats are dropped with it)."""
        stats = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            stats, self._pending = self._pending, None
        if self._error is not None:
            err, self._error = self._error, None
            try:
                raise err
            finally:
                # Its traceback holds this frame: kept here, it would be a cycle holding this checkpointer and the
                # save's barrier, with the process group it closes over (see fail_together).
                del err
        if stats is not None:
            self.last_stats = stats
        return self.last_stats

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.wait()
            return False
        try:
            self.wait()  # a second Ctrl-C stops the wait; the next save removes the unfinished tmp folder
        except BaseException as err:  # noqa: BLE001 - reported on the exception that is leaving
            exc.add_note(f"the checkpoint save in flight did not complete: {type(err).__name__}: {err}")
        return False

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _snapshot(self, shards: Sequence[ShardSpec]) -> list[ShardSpec]:
        out, on_cuda = [], False
        for i, s in enumerate(shards):
            require_shard_spec(s, i)
            if not s.writer:  # no data is written: kept so that the save can check some rank writes it
                out.append(s)
                continue
            src = s.tensor.detach()
            key = f"{s.name}{describe(s.region)}"
            buf = self._buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
                if self.reuse_buffers:
                    self._buffers[key] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            on_cuda |= src.is_cuda
            out.append(ShardSpec(s.name, s.global_shape, buf, s.region, True))
        if on_cuda:
            torch.cuda.synchronize()
        return out


_UNSETTLED: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()  # checkpointers that started a save
_exit_hook: list[bool] = []  # [True] once _settle_all is registered


def _settle_at_exit(checkpointer: AsyncCheckpointer) -> None:
    """Settle `checkpointer`'s save at interpreter exit if nobody does before. The hook is threading's exit hook
    (what concurrent.futures uses), registered at the first save: it runs before the one concurrent.futures
    registered on import, after which no executor takes work (the shard writer uses one). An `atexit` handler
    runs after that, too late: the save then failed with "cannot schedule new futures after interpreter shutdown"."""
    if not _exit_hook:
        register = getattr(threading, "_register_atexit", atexit.register)  # private, CPython >= 3.9
        try:
            register(_settle_all)
        except RuntimeError:  # a save started while the interpreter is shutting down: its caller waits, or nobody
            return
        _exit_hook.append(True)
    _UNSETTLED.add(checkpointer)


def _settle_all() -> None:
    for checkpointer in list(_UNSETTLED):
        _settle(checkpointer)


def _settle(checkpointer: AsyncCheckpointer) -> None:
    """Wait for a save nobody waited for, saying so on stderr, and say how it ended: committed, failed, abandoned."""
    if checkpointer._thread is None and checkpointer._error is None:
        return  # wait() was called: its caller saw how the save ended
    path = checkpointer._pending.path if checkpointer._pending is not None else "the last save"
    if checkpointer.busy:
        print(f"moe-ckpt: the interpreter is exiting with the checkpoint save of {path} in flight (no wait(), no "
              "`with AsyncCheckpointer()` block left): waiting for it to commit, at most the barrier group's "
              "timeout when another rank is gone (Ctrl-C abandons it)", file=sys.stderr, flush=True)
    try:
        checkpointer.wait()
    except KeyboardInterrupt:
        print(f"moe-ckpt: the checkpoint save of {path} was abandoned at exit; it is not committed (the next save "
              "removes its tmp folder)", file=sys.stderr, flush=True)
    except BaseException as err:  # noqa: BLE001 - at exit there is no caller left to raise it to
        print(f"moe-ckpt: the checkpoint save of {path} failed and is not committed: {type(err).__name__}: {err}",
              file=sys.stderr, flush=True)
    else:
        print(f"moe-ckpt: the checkpoint save of {path} committed at exit", file=sys.stderr, flush=True)


class _Failed(list):
    """The shards of a save whose snapshot failed on this rank: empty, but writing them raises that error (on the
    background thread, inside the save's protocol, so every rank's save fails naming it instead of the others
    waiting at a barrier this rank never reaches). The save drops the error when it ends: frames on the error's
    traceback (save()'s, the writer's) hold these shards, a cycle that would keep the save's barrier, with the process
    group it closes over, alive after the caller dropped the error (see fail_together)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error: Exception | None = error

    def __iter__(self):
        raise self.error
