"""Spawned ranks of test_qa64.py (importable by name, so child processes can unpickle them).

Each case runs with the garbage collector disabled on a gloo group of its own (the all-reduce handed to
fail_together, the barrier handed to a save), catches and drops the error, destroys the group, and reports whether
weak references to the group and to the object that held it are dead, without calling gc.collect (after it too, to
tell a reference cycle from another holder). Results go to root/rank{r}.pt.
"""

from __future__ import annotations

import gc
import os
import traceback
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import moe_ckpt
from moe_ckpt import AsyncCheckpointer, Box, ShardSpec, fail_together, save_checkpoint, step_dir

WORLD, BAD = 2, 1  # rank BAD fails in the failing cases
TIMEOUT = timedelta(seconds=30)  # a rank left waiting fails after this instead of hanging the test


class _Part:
    """This rank's part of a fail_together step (an object, so that a weak reference can follow it)."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def __call__(self) -> str:
        if self.fails:
            raise OSError("shard file damaged")
        return "read"


def _load_step(rank: int, group: dist.ProcessGroup, root: Path, n: int, fails: bool, watch: list) -> None:
    part = _Part(fails and rank == BAD)
    watch.append(weakref.ref(part))
    fail_together(part, rank, WORLD, lambda t: (dist.all_reduce(t, group=group), t)[1], "checkpoint load")


def _shards(rank: int, listed_twice: bool) -> list[ShardSpec]:
    piece = ShardSpec("w", (4,), torch.full((2,), float(rank)), Box.dim0((4,), 2 * rank, 2))
    return [piece, piece] if listed_twice else [piece]  # a piece listed twice: the shard write refuses it


def _save(rank: int, group: dist.ProcessGroup, root: Path, n: int, fails: bool, watch: list) -> None:
    """save_checkpoint where rank 0's metadata (the one written) is not JSON: refused while preparing the save."""
    metadata = {"step": n, "sched": object()} if fails and rank == 0 else {"step": n}
    shards = _shards(rank, False)
    watch.append(weakref.ref(shards[0].tensor))
    save_checkpoint(step_dir(root, n), shards, metadata, rank, WORLD, lambda: dist.barrier(group=group))


def _async_save(rank: int, group: dist.ProcessGroup, root: Path, n: int, fails: bool, watch: list) -> None:
    """An async save whose shard write fails on rank BAD (a piece listed twice)."""
    checkpointer = AsyncCheckpointer()
    watch.append(weakref.ref(checkpointer))
    checkpointer.save(step_dir(root, n), _shards(rank, fails and rank == BAD), {"step": n}, rank, WORLD,
                      lambda: dist.barrier(group=group))
    checkpointer.wait()


def _async_snapshot(rank: int, group: dist.ProcessGroup, root: Path, n: int, fails: bool, watch: list) -> None:
    """An async save whose snapshot fails on rank BAD (a meta tensor cannot be copied to the host)."""
    checkpointer = AsyncCheckpointer()
    watch.append(weakref.ref(checkpointer))
    shards = _shards(rank, False)
    if fails and rank == BAD:
        shards = [ShardSpec("w", (4,), torch.empty(2, device="meta"), Box.dim0((4,), 2 * rank, 2))]
    checkpointer.save(step_dir(root, n), shards, {"step": n}, rank, WORLD, lambda: dist.barrier(group=group))
    checkpointer.wait()


CASES = {  # name: (what runs, whether it fails)
    "fail_together_good": (_load_step, False),
    "fail_together_failed": (_load_step, True),
    "save_good": (_save, False),
    "save_failed": (_save, True),
    "async_save_good": (_async_save, False),
    "async_save_failed": (_async_save, True),
    "async_snapshot_failed": (_async_snapshot, True),
}


def _attempt(rank: int, root: Path, n: int, run, fails: bool) -> tuple[str, list[weakref.ref]]:  # noqa: ANN001
    """How run() ended, and weak references to its group and to what run() watched (the objects that held the
    group: the all-reduce's caller part, the checkpointer), taken after the group was destroyed and the error
    dropped (nothing in this frame, gone once it returns, holds them)."""
    group = dist.new_group(list(range(WORLD)), backend="gloo", timeout=TIMEOUT)
    watch = [weakref.ref(group)]
    try:
        run(rank, group, root, n, fails, watch)
        outcome = "ok"
    except Exception as e:  # noqa: BLE001 - the test checks which error
        outcome = f"{type(e).__name__}: {e}"  # `e` is unbound when the except clause ends: only the frames hold it
    dist.destroy_process_group(group)
    return outcome, watch


def _cases(rank: int, root: Path) -> dict:
    res = {}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for n, (name, (run, fails)) in enumerate(CASES.items(), start=1):
            outcome, (group, *held) = _attempt(rank, root, n, run, fails)
            res[name] = {"outcome": outcome, "group_freed": group() is None,
                         "holder_freed": all(ref() is None for ref in held)}
            gc.collect()  # for the report only: whether a reference cycle held them (freed now) or something else
            res[name]["freed_by_gc"] = group() is None and all(ref() is None for ref in held)
            dist.barrier()
    finally:
        if was_enabled:
            gc.enable()
    return res


def run_rank(rank: int, root: str) -> None:
    res: dict = {"moe_ckpt_file": moe_ckpt.__file__}
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=WORLD,
                                timeout=TIMEOUT)
        try:
            res.update(_cases(rank, Path(root) / "run"))
        finally:
            dist.destroy_process_group()
            gc.collect()  # no group lives into interpreter exit (pytorch#190489)
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(root, f"rank{rank}.pt"))
