"""The two gloo ranks of test_qa105.py (each operation of each rank's save fails in turn), in a module of their own so
that the forkserver can start them: a rank forked from a pytest worker inherits that worker's garbage (earlier tests'
process groups, threads and mapped files), and a forked rank of moe-train's QA 109 died with SIGSEGV collecting it."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from ckpt_cases import bits_equal, make_state, shards_for
from fs_faults import Faults

from moe_ckpt import find_latest, list_checkpoints, load_checkpoint, save_checkpoint, step_dir
from moe_ckpt.run_dir import read_latest


def rank_main(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    report: dict = {"cases": []}
    try:
        run = Path(root)
        calls = [0]

        def barrier():
            calls[0] += 1
            dist.barrier()
        state1, state2 = make_state(1), make_state(2)
        save_checkpoint(step_dir(run / "base", 1), shards_for(state1, rank, world), {"step": 1}, rank, world, barrier)
        # count this rank's operations of a clean save of step 2
        mp = pytest.MonkeyPatch()
        if rank == 0:
            shutil.copytree(run / "base", run / "count")
        barrier()
        faults = Faults(run / "count")
        with faults.active(mp):
            save_checkpoint(step_dir(run / "count", 2), shards_for(state2, rank, world), {"step": 2}, rank, world,
                            barrier, keep_last_n=1)
        counts = torch.zeros(world, dtype=torch.int64)
        counts[rank] = len(faults.ops)
        dist.all_reduce(counts)
        for bad in range(world):
            for i in range(1, int(counts[bad]) + 1):
                case = run / f"r{bad}op{i}"
                if rank == 0:
                    shutil.copytree(run / "base", case)
                barrier()
                faults = Faults(case)
                outcome = "ok"
                with faults.active(mp, fail_at=i if rank == bad else None):
                    try:
                        save_checkpoint(step_dir(case, 2), shards_for(state2, rank, world), {"step": 2}, rank, world,
                                        barrier, keep_last_n=1)
                    except Exception as e:  # noqa: BLE001 - reported
                        outcome = f"{type(e).__name__}: {e}"
                barrier()
                rec = {"bad": bad, "i": i, "outcome": outcome, "failed": faults.failed if rank == bad else None,
                       "barriers": calls[0]}
                report["cases"].append(rec)
                if rank == 0:  # what is on disk, then the retry
                    rec["committed"] = (step_dir(case, 2) / "index.json").is_file()
                    rec["found"] = [p.name for p in list_checkpoints(case)]
                    rec["latest"] = getattr(read_latest(case), "name", None)
                    newest = find_latest(case)
                    got = load_checkpoint(newest)
                    want = state2 if newest.name == "step-00000002" else state1
                    rec["bit_exact"] = all(bits_equal(got[k], want[k]) for k in want)
                barrier()
                retry = step_dir(case, 3)
                save_checkpoint(retry, shards_for(state2, rank, world), {"step": 3}, rank, world, barrier,
                                keep_last_n=1)
                barrier()  # every rank is past its save's last check before rank 0 reads and removes the folder
                if rank == 0:
                    got = load_checkpoint(case)
                    rec["retry_bit_exact"] = all(bits_equal(got[k], state2[k]) for k in state2)
                    rec["after_retry"] = sorted(p.name for p in case.iterdir())
                    shutil.rmtree(case)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        report["error"] = traceback.format_exc()
        raise SystemExit(1) from e
    finally:
        torch.save(report, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
