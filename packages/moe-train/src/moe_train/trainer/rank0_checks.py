"""Checks that rank 0 alone runs (the run folder and its log are rank 0's) and every rank stops with."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_train.trainer.runtime import Runtime


def checked_on_rank0(runtime: Runtime, check: Callable[[], None], on_other_ranks: Exception) -> None:
    """Rank 0 runs `check`; its error, whatever its type, is raised there and `on_other_ranks` everywhere else, so
    every rank stops together (one all-reduce). Any type: a NotADirectoryError from the lock, or an ENOSPC from a
    metrics.jsonl write, raised on rank 0 alone left the others waiting in their next collective (gloo:
    "Connection closed by peer"; NCCL: the collective timeout)."""
    refused: Exception | None = None
    if runtime.rank == 0:
        try:
            check()
        except Exception as e:  # noqa: BLE001 - shared below, then raised
            refused = e
    flag = runtime.all_reduce_sum(torch.tensor([float(refused is not None)], device=runtime.device))
    try:
        if refused is not None:
            raise refused
    finally:
        del refused  # its traceback holds this frame: no cycle keeping the error (and the runtime) alive
    if flag.item() > 0:
        raise on_other_ranks
