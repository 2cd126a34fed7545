"""fail_together: one rank's failed checkpoint read becomes every rank's error, at once.

Without it a rank whose shard file is damaged raises alone while the others, whose reads
succeeded, go on to their next collective and wait there for the timeout. The package still
knows nothing of process groups: the caller hands in a sum all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from moe_ckpt.errors import PeerCheckpointError

T = TypeVar("T")
AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


def fail_together(fn: Callable[[], T], rank: int, world_size: int, all_reduce_sum: AllReduceSum | None,
                  what: str = "checkpoint load") -> T:
    """Run this rank's part `fn`, then learn whether any rank's part failed; if one did, every rank raises.

    Call on every rank, once per collective step. all_reduce_sum(t) sums an int64 CPU tensor
    [world_size] over the ranks and returns the result (move it to the device for NCCL), e.g.
    `lambda t: (dist.all_reduce(t), t)[1]` on gloo. The rank that failed raises its own error; the
    others raise PeerCheckpointError naming it. Exceptions that are not `Exception`s (Ctrl-C) are not
    shared: they end this process, and the peers' next collective fails with it.
    """
    if world_size == 1:
        return fn()
    if not callable(all_reduce_sum):  # None failed after fn() ran, as "'NoneType' object is not callable"
        raise TypeError(f"world_size={world_size!r} needs all_reduce_sum, a callable that sums a tensor over the "
                        f"ranks (e.g. lambda t: (dist.all_reduce(t), t)[1]); got {all_reduce_sum!r}")
    failed = torch.zeros(world_size, dtype=torch.int64)
    error: Exception | None = None
    try:
        result = fn()
    except Exception as e:  # shared below, then raised
        error = e
        failed[rank] = 1
    try:
        ranks = [r for r, f in enumerate(all_reduce_sum(failed).tolist()) if f]
        others = [r for r in ranks if r != rank]
        if error is not None:
            if others:
                error.add_note(f"{what} also failed on rank(s) {', '.join(map(str, others))} of {world_size}")
            raise error
    finally:
        # The error's traceback holds this frame: kept here, it would be a cycle that keeps all_reduce_sum (and the
        # process group it closes over, with gloo's worker threads) alive after the caller dropped the error, until
        # the garbage collector runs; a gloo group alive at interpreter exit can abort the process (pytorch#190489).
        del error
    if ranks:
        raise PeerCheckpointError(f"rank {rank}: {what} failed on rank{'s' if len(ranks) > 1 else ''} "
                                  f"{', '.join(map(str, ranks))} of {world_size} (its own error names the cause); "
                                  "this rank's part succeeded")
    return result
