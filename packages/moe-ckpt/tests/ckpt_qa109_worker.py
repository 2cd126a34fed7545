"""The two gloo ranks of test_qa109.py (an I/O error at each read of a two-phase load), with the helpers the test
shares, in a module of their own so that the forkserver can start them: a rank forked from a pytest worker inherits
that worker's garbage (earlier tests' process groups, threads and mapped files), and a forked rank of moe-train's
QA 109 died with SIGSEGV collecting it."""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from ckpt_cases import check_load, make_state, requests_for, shards_for
from fs_faults import Faults

from moe_ckpt import fail_together, load_checkpoint, load_metadata, save_checkpoint, step_dir

STATE1, STATE2 = make_state(1), make_state(2)


def message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}"


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root with its kind and, for a file, a digest of its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


TIMEOUT_S = 5.0


def rank_main(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    report: dict = {"cases": []}
    try:
        run = Path(root) / "run"
        for step, state in ((1, STATE1), (2, STATE2)):
            save_checkpoint(step_dir(run, step), shards_for(state, rank, world), {"step": step}, rank, world,
                            dist.barrier)
        reqs = requests_for(rank, world, "dim0")

        def all_reduce_sum(t):
            dist.all_reduce(t)
            return t

        def load():  # a resume's two phases, each failing together
            got = fail_together(lambda: load_checkpoint(run, reqs), rank, world, all_reduce_sum, f"loading {run}")
            fail_together(lambda: load_metadata(run), rank, world, all_reduce_sum, f"reading {run}'s metadata")
            return got

        before = snapshot(run) if rank == 0 else None
        mp = pytest.MonkeyPatch()
        faults = Faults(run, reads=True)
        with faults.active(mp):
            check_load(STATE2, load(), reqs)
        counts = torch.zeros(world, dtype=torch.int64)
        counts[rank] = len(faults.ops)
        dist.all_reduce(counts)
        n = [int(c) for c in counts]
        cases = [("rank 0", (i, None)) for i in range(1, n[0] + 1)]
        cases += [("rank 1", (None, i)) for i in range(1, n[1] + 1)]
        cases += [("both", (i, (i + n[1] // 3 - 1) % n[1] + 1)) for i in range(1, n[0] + 1)]
        for scenario, fail_at in cases:
            faults = Faults(run, reads=True)
            start = time.monotonic()
            with faults.active(mp, fail_at=fail_at[rank], kind="EIO"):
                try:
                    load()
                    outcome = "ok"
                except Exception as e:  # noqa: BLE001 - reported
                    outcome = message(e)
                    kind = type(e).__name__
            seconds = time.monotonic() - start
            t = torch.ones(1)
            dist.all_reduce(t)  # the ranks are still in step
            report["cases"].append({"scenario": scenario, "fail_at": fail_at, "outcome": outcome,
                                    "kind": kind if outcome != "ok" else None, "failed": faults.failed,
                                    "seconds": seconds, "then": t.item()})
        dist.barrier()
        if rank == 0:
            report["unchanged"] = snapshot(run) == before
        check_load(STATE2, load(), reqs)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        report["error"] = traceback.format_exc()
        raise SystemExit(1) from e
    finally:
        torch.save(report, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
