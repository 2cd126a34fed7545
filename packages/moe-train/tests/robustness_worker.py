"""Spawned worker of test_resume_robustness.py (importable by name, so child processes can unpickle it).

One spawn of two gloo ranks runs both checks (a spawn costs seconds of imports)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import test_parallel_harness as h
from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig


def two_rank_config(run_dir: Path, data_dir: str, steps: int) -> Config:
    cfg = Config(
        model=ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=64,
                          dense_layers=[0], num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2)),
        data=DataConfig(path=data_dir, seq_len=16),
        train=TrainConfig(steps=steps, micro_batch_size=2, grad_accum=1, warmup_steps=1, eval_interval=0,
                          log_interval=1, save_interval=1, run_dir=str(run_dir), progress=False, device="cpu",
                          threads=1),
        preset="test",
    )
    cfg.parallel.dp = 2
    cfg.parallel.collective_timeout_s = 5.0
    return cfg


def background_barrier_timeout(rank: int, out_dir: Path) -> dict:
    """Rank 1 stays alive but never reaches the async writer's barrier; rank 0's must fail after
    parallel.collective_timeout_s, not after torch's 30-minute default for a new group."""
    from moe_train.trainer.launch import make_runtime

    cfg = h.shrunk_tiny(dp=2)
    cfg.parallel.collective_timeout_s = 2.0
    barrier = make_runtime(cfg, torch.device("cpu")).background_barrier()
    done = out_dir / "rank0.done"
    out: dict = {}
    if rank == 0:
        start = time.monotonic()
        try:
            barrier()
            out["result"] = "returned"
        except RuntimeError as e:
            out["result"] = str(e)
        out["seconds"] = time.monotonic() - start
        done.touch()
    else:
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    torch.distributed.destroy_process_group()
    return out


def resume_from_a_corrupt_shard(rank: int, ports: list[int], out_dir: Path, data_dir: str) -> dict:
    """Train one step on DP2 and save; rank 1 damages its own shard file (only rank 1 reads it back: the
    replicated weights and rank 0's optimizer ranges live in shard 0); then both ranks resume."""
    from moe_train.trainer.loop import Trainer

    run = out_dir / "run"
    h.worker_env(rank, 2, ports[0])
    Trainer(two_rank_config(run, data_dir, 1)).train()  # closes the process group
    if rank == 1:
        shard = run / "checkpoints" / "step-00000001" / "shard-00001-of-00002.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF  # same size, wrong checksum
        shard.write_bytes(bytes(raw))
    h.worker_env(rank, 2, ports[1])  # rank 0 waits in the rendezvous until rank 1 is done
    start = time.monotonic()
    try:
        Trainer(two_rank_config(run, data_dir, 2)).train()
        out = {"error": None, "message": ""}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = {"error": type(e).__name__, "message": str(e)}
    out["seconds"] = time.monotonic() - start
    return out


def worker(rank: int, ports: list[int], out_dir: str, data_dir: str) -> dict:
    h.worker_env(rank, 2, ports[0])
    return {"barrier": background_barrier_timeout(rank, Path(out_dir)),
            "corrupt": resume_from_a_corrupt_shard(rank, ports[1:], Path(out_dir), data_dir)}
