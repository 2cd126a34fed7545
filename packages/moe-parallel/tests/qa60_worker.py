"""Spawned ranks of test_qa60.py (importable by name, so child processes can unpickle them).

Each check runs on a group of its own with a short timeout, so on code where one rank's refusal leaves the
other waiting, that rank fails with gloo's timeout (or "connection closed") instead of hanging the test.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import moe_parallel
from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams
from outcome import timed_outcome as _outcome

CHECK_TIMEOUT = timedelta(seconds=6)


def _params(rank: int, case: str) -> list[tuple[str, nn.Parameter]]:
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(3, 2))
    if rank == 1 and case == "dtype":
        b = nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    if rank == 1 and case == "frozen":
        b.requires_grad_(False)
    if rank == 1 and case == "empty":
        return []
    if rank == 1 and case == "shape":
        b = nn.Parameter(torch.ones(2, 3))
    return [("a", a), ("b", b)]


def check_flat_params(rank: int, case: str) -> dict:
    """FlatParams refused on rank 1 only (its own check, or a shape the ranks compare)."""
    group = dist.new_group([0, 1], timeout=CHECK_TIMEOUT)
    return _outcome(lambda: FlatParams(_params(rank, case), group, shard=True))


def check_optimizer_given_a_flat_twice(rank: int) -> dict:
    """DistributedAdamW given one FlatParams twice on rank 1 only: refused there before its collective check."""
    group = dist.new_group([0, 1], timeout=CHECK_TIMEOUT)
    flat = FlatParams(_params(rank, "same"), group, shard=True)
    flats = [flat, flat] if rank == 1 else [flat]
    return _outcome(lambda: DistributedAdamW(flats, AdamWConfig(lr=0.1), world=group))


def check_group_still_usable(rank: int) -> dict:
    """After a refusal both ranks met in the same collectives: the group carries on (a FlatParams and a step)."""
    group = dist.new_group([0, 1], timeout=CHECK_TIMEOUT)
    _outcome(lambda: FlatParams(_params(rank, "dtype"), group, shard=True))
    w = nn.Parameter(torch.full((4,), float(rank)))
    FlatParams([("w", w)], group, shard=True)  # broadcasts the group's first rank's weights into w
    return {"w": w.detach().tolist()}


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {"moe_parallel_file": moe_parallel.__file__}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        checks = {f"flat_{case}": (check_flat_params, rank, case) for case in ("dtype", "frozen", "empty", "shape")}
        checks["optimizer_flat_twice"] = (check_optimizer_given_a_flat_twice, rank)
        checks["still_usable"] = (check_group_still_usable, rank)
        for key, (fn, *args) in checks.items():
            try:
                res[key] = fn(*args)
            except Exception:  # noqa: BLE001 - the test names it; the other checks still run
                res[key] = {"outcome": traceback.format_exc(), "seconds": -1.0}
            # the rank that refused waits here for the other (on the old code: until its check timed out)
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
