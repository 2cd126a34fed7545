"""The two gloo ranks of tests/test_qa109.py (QA 109 through the trainer), in a module of their own so that the
forkserver can start them: a rank forked from a pytest worker inherits that worker's garbage (earlier tests' process
groups, threads and mapped files) and once died with SIGSEGV collecting it at exit, after its report was saved."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch

import robustness_worker as rw
from ckpt_faults import faults_module
import test_parallel_harness as h
from moe_ckpt import CheckpointError

TIMEOUT_S = 5.0  # robustness_worker.two_rank_config's parallel.collective_timeout_s


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def pick(ops: list[tuple[str, str]], op: str, name: str) -> int:
    """The 1-based index of the first operation `op` on a file called `name`."""
    return next(i for i, (o, p) in enumerate(ops, 1) if o == op and Path(p).name == name)


CASES = ("rank 1", "both", "rank 0")


def rank_main(rank: int, ports: list[int], root: str, data: str) -> None:
    from moe_train.trainer.loop import Trainer

    ff = faults_module()
    run = Path(root) / "run"
    report: dict = {}
    try:
        h.worker_env(rank, 2, ports[0])
        Trainer(rw.two_rank_config(run, data, 1)).train()  # step 1 saved; a resume to steps=1 trains nothing
        before = snapshot(run / "checkpoints")
        mp = pytest.MonkeyPatch()
        h.worker_env(rank, 2, ports[1])
        counted = ff.Faults(run / "checkpoints", reads=True)
        with counted.active(mp):
            Trainer(rw.two_rank_config(run, data, 1)).train()
        ops = counted.ops
        shard = f"shard-{rank:05d}-of-00002.safetensors"
        fail_at = {"rank 1": pick(ops, "safe_open", shard) if rank == 1 else None,
                   "both": pick(ops, "file.read", "index.json") if rank == 0 else pick(ops, "file.readinto", shard),
                   "rank 0": len(ops) if rank == 0 else None}
        assert rank == 1 or ops[-1] == ("file.read", "step-00000001/metadata.json"), ops[-1]
        for case, port in zip(CASES, ports[2:]):
            h.worker_env(rank, 2, port)
            faults = ff.Faults(run / "checkpoints", reads=True)
            start = time.monotonic()
            with faults.active(mp, fail_at=fail_at[case], kind="EIO"):
                try:
                    Trainer(rw.two_rank_config(run, data, 1)).train()
                    outcome = None
                except Exception as e:  # noqa: BLE001 - reported
                    outcome = e
            report[case] = {"error": type(outcome).__name__ if outcome else None, "message": str(outcome),
                            "damaged": isinstance(outcome, CheckpointError) and "cannot be resumed" in str(outcome),
                            "failed": faults.failed, "seconds": time.monotonic() - start}
        report["unchanged"] = snapshot(run / "checkpoints") == before
    except BaseException:  # noqa: BLE001 - reported to the test
        import traceback

        report["crash"] = traceback.format_exc()
    torch.save(report, Path(root) / f"rank{rank}.pt")
    h.release_process_groups()
