"""Spawned worker of test_bench_ranks.py (importable by name, so child processes can unpickle it)."""

from __future__ import annotations

import contextlib
import io

import test_parallel_harness as h
from moe_train.cli import main

SMALL = ["--parallel.dp=2", "--train.device=cpu", "--model.d_model=32", "--model.num_layers=2",
         "--model.dense_hidden=64", "--model.expert_hidden=32", "--model.vocab_size=256", "--data.seq_len=16",
         "--train.micro_batch_size=2", "--train.grad_accum=1"]


def bench_rank(rank: int, port: int, out: str) -> dict:
    """`moe-train bench` as torchrun would run it on this rank: its exit status and what it printed."""
    h.worker_env(rank, 2, port)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["bench", "--steps", "2", "--warmup", "1", "--out", out, *SMALL])
    return {"status": status, "printed": printed.getvalue()}
