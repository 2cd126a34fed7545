"""Spawned ranks of test_qa64.py (importable by name, so child processes can unpickle them).

Each case runs with the garbage collector disabled on a gloo group of its own, catches and drops the error, destroys
the group, and reports whether weak references to the group and to a parameter handed in are dead, without calling
gc.collect (after it too, to tell a reference cycle from another holder).
"""

from __future__ import annotations

import gc
import os
import traceback
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import moe_parallel
from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams

WORLD, BAD = 2, 1  # rank BAD refuses in the refused cases
CHECK_TIMEOUT = timedelta(seconds=30)


def _params(rank: int, frozen: bool) -> list[tuple[str, nn.Parameter]]:
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(3, 2))
    if frozen and rank == BAD:
        b.requires_grad_(False)
    return [("a", a), ("b", b)]


def _flat_params(rank: int, group: dist.ProcessGroup, params: list, case: str) -> None:
    FlatParams(params, group, shard=True)


def _optimizer(rank: int, group: dist.ProcessGroup, params: list, case: str) -> None:
    flat = FlatParams(params, group, shard=True)
    flats = [flat, flat] if (case == "refused" and rank == BAD) else [flat]  # one FlatParams given twice: refused
    DistributedAdamW(flats, AdamWConfig(lr=0.1), world=group)


def _attempt(rank: int, build, alone: bool, case: str) -> tuple[str, weakref.ref, weakref.ref]:  # noqa: ANN001
    """How build() ended, and weak references to its group and a parameter it was given, taken after the group
    was destroyed and the error dropped (nothing else in this frame, gone once it returns, holds them)."""
    if alone:  # a group of this rank alone: the refusal is raised without any exchange
        group = dist.new_group([rank], timeout=CHECK_TIMEOUT, use_local_synchronization=True)
    else:
        group = dist.new_group(list(range(WORLD)), timeout=CHECK_TIMEOUT)
    params = _params(rank, frozen=case == "refused" and build is _flat_params)
    param = weakref.ref(params[1][1])
    try:
        build(rank, group, params, case)
        outcome = "accepted"
    except ValueError as e:
        outcome = f"ValueError: {e}"  # `e` is unbound when the except clause ends: only the frames hold it now
    del params
    dist.destroy_process_group(group)
    return outcome, weakref.ref(group), param


CASES = {  # name: (what is built, on a group of one rank, "good" or "refused")
    "flat_params_good": (_flat_params, False, "good"),
    "flat_params_frozen": (_flat_params, False, "refused"),
    "flat_params_frozen_alone": (_flat_params, True, "refused"),
    "optimizer_good": (_optimizer, False, "good"),
    "optimizer_flat_twice": (_optimizer, False, "refused"),
    "optimizer_flat_twice_alone": (_optimizer, True, "refused"),
}


def _cases(rank: int) -> dict:
    res = {}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name, (build, alone, case) in CASES.items():
            outcome, group, param = _attempt(rank, build, alone, case)
            res[name] = {"outcome": outcome, "group_freed": group() is None, "param_freed": param() is None}
            gc.collect()  # for the report only: whether a reference cycle held them (freed now) or something else
            res[name]["freed_by_gc"] = group() is None and param() is None
            dist.barrier()  # rank 0 hosts the store a group of one rank is made through: it stays until all are done
    finally:
        if was_enabled:
            gc.enable()
    return res


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {"moe_parallel_file": moe_parallel.__file__}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        res.update(_cases(rank))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
