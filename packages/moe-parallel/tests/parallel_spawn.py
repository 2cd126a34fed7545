"""Spawning a test's gloo ranks with a deadline (shared by the multi-rank tests of this folder): ranks that
stop meeting in the same collective would otherwise wait for gloo's timeout, so the test fails instead."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a server that has imported these once: a freshly spawned interpreter spends ~3 s of CPU
# importing torch, on every rank of every multi-rank test (CI has 2 cores). What a rank needs travels as its
# arguments: a forked rank does not see environment variables set in the test process after the server started.
mp.set_forkserver_preload(["torch", "torch.distributed", "moe_kernels", "moe_parallel"])


def free_port() -> int:
    """A TCP port nothing listens on, for a process group's store, drawn at random below the kernel's ephemeral
    range. A port-0 pick (the kernel's, closed and bound again later by the store) could be handed in between to a
    port-0 bind of another process, the other pytest worker's gloo listeners among them, leaving the ranks waiting
    for a store that is not theirs (review helper 169); the kernel never hands out a port below that range."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range's start, where most kernels begin
        low = 49152
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))  # as the store binds it: every address
            except OSError:  # taken: draw again
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port found in [10000, {low})")


def release_process_groups() -> None:
    """End a spawned rank with no process group alive. A group that outlives its rank's work (not destroyed, or
    held by a reference cycle the garbage collector has not reached) keeps gloo's worker threads running into
    interpreter exit, where one still releasing a collective's tensors takes the GIL and aborts the rank with
    SIGABRT ("terminate called without an active exception", pytorch#190489), after its results were saved."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # a group freed here has its threads joined while the interpreter is whole


def _rank_main(rank: int, worker: Callable, *args) -> None:
    try:
        worker(rank, *args)
    finally:
        release_process_groups()


def spawn_with_deadline(worker: Callable, args: tuple, nprocs: int, deadline_s: float) -> None:
    """torch.multiprocessing.spawn(worker, args) on nprocs ranks (forkserver-started), each ending with release_process_groups(); pytest.fail, killing
    them, past deadline_s."""
    context = mp.start_processes(_rank_main, args=(worker, *args), nprocs=nprocs, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{nprocs} ranks did not finish within {deadline_s} s (mismatched collectives?)")


def run_ranks(run_rank: Callable, world: int, out_dir: Path, deadline_s: float) -> list[dict]:
    """run_rank(rank, world, port, out_dir) on `world` ranks, each saving a result dict to out_dir/rank{rank}.pt
    (with an "error" entry if it failed): the dicts, after failing the test on the first rank's error."""
    spawn_with_deadline(run_rank, (world, free_port(), str(out_dir)), world, deadline_s)
    results = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} of {world} failed:\n{res['error']}"
    return results
