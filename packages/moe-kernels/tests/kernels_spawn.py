"""Running a test file's ranks as spawned gloo processes (shared by the multi-rank tests of this folder).

The test file defines a module-level `_entry(*lead_args, rank, port, out_dir)` (or another name) that initialises gloo on
127.0.0.1:port, runs its cases and saves a result dict to out_dir/rank{rank}.pt (also when it fails).
Children unpickle `_entry` by the test file's plain module name: under `uv run pytest` (CI) the file is
not importable by the dotted name pytest gave it, so its folder goes on sys.path first.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a server that has imported these once: a freshly spawned interpreter spends ~3 s of CPU
# importing torch, on every rank of every multi-rank test (CI has 2 cores). What a rank needs travels as its
# arguments: a forked rank does not see environment variables set in the test process after the server started.
mp.set_forkserver_preload(["torch", "torch.distributed", "moe_kernels"])


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


def spawn(test_file: str, world: int, out_dir: Path, deadline_s: float, *lead_args,
          entry: str = "_entry") -> list[tuple[dict, int | None, bool]]:
    """Run test_file's function `entry` (default `_entry`) on every rank. Per rank: (its saved result dict, or
    {} if it saved none; its exit code; whether it was still running after deadline_s and was killed)."""
    port = free_port()
    sys.path.insert(0, str(Path(test_file).parent))
    target = getattr(importlib.import_module(Path(test_file).stem), entry)
    ctx = mp.get_context("forkserver")
    procs = [ctx.Process(target=_rank_main, args=(target, *lead_args, r, port, str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.0))
    runs = []
    for r, p in enumerate(procs):
        hung = p.is_alive()
        if hung:
            p.kill()
            p.join()
        f = Path(out_dir) / f"rank{r}.pt"
        runs.append((torch.load(f, weights_only=False) if f.exists() else {}, p.exitcode, hung))
    return runs


def release_process_groups() -> None:
    """End a spawned rank with no process group alive. A group that outlives its rank's work (not destroyed, or
    held by a reference cycle the garbage collector has not reached) keeps gloo's worker threads running into
    interpreter exit, where one still releasing a collective's tensors takes the GIL and aborts the rank with
    SIGABRT ("terminate called without an active exception", pytorch#190489), after its results were saved."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # a group freed here has its threads joined while the interpreter is whole


def _rank_main(target: Callable, *args) -> None:
    try:
        target(*args)
    finally:
        release_process_groups()


def results_or_fail(runs: list[tuple[dict, int | None, bool]], deadline_s: float) -> list[dict]:
    """Each rank's result dict; an AssertionError naming the ranks that hung or died without saving one."""
    hung = [r for r, (_, _, h) in enumerate(runs) if h]
    assert not hung, f"ranks {hung} did not finish within {deadline_s} s (a collective one rank never joined?)"
    for r, (res, code, _) in enumerate(runs):
        assert res, f"rank {r} died without a result (exit code {code}; a gloo abort on mismatched rows?)"
    return [res for res, _, _ in runs]


def results_without_errors(test_file: str, world: int, out_dir: Path, deadline_s: float, *lead_args,
                           entry: str = "_entry") -> list[dict]:
    """spawn + results_or_fail, asserting that no rank saved an error (run_gloo_rank's {"error", "traceback"})."""
    results = results_or_fail(spawn(test_file, world, out_dir, deadline_s, *lead_args, entry=entry), deadline_s)
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}: {res.get('error')}\n{res.get('traceback')}"
    return results


def run_gloo_rank(rank: int, port: int, out_dir: str, world: int, timeout_s: float,
                  cases: Callable[[int], dict]) -> None:
    """An `_entry` body: join gloo on 127.0.0.1:port (collectives time out after timeout_s), save cases(rank)
    to out_dir/rank{rank}.pt, or {"error", "traceback"} when anything raised."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        res = cases(rank)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@contextlib.contextmanager
def one_gloo_rank() -> Iterator[dist.ProcessGroup]:
    """A gloo group of this process alone (in the test process itself: nothing spawned), destroyed on exit."""
    port = free_port()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
