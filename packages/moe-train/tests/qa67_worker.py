"""The spawned ranks of test_qa67.py (importable by name, so spawned ranks can unpickle them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import test_parallel_harness as h
from test_parallel_harness import small_config

SEQ_LEN = 32  # small_config's data.seq_len


def poison_rank1s_first_window(data_dir: Path, seed: int = 0) -> int:
    """Put id 600 (>= small_config's vocab_size 512) in the window DP rank 1 of 2 draws first (global index 1 of a
    shuffled epoch 0), and in no window rank 0 draws in the same micro-batch. Returns the token's index."""
    path = Path(data_dir) / "train.u32"
    tokens = np.fromfile(path, dtype="<u4")
    perm = np.random.default_rng([seed, 0]).permutation((tokens.size - 1) // SEQ_LEN)
    at = int(perm[1]) * SEQ_LEN + 1  # inside that window only (windows share their first and last tokens)
    tokens[at] = 600
    tokens.tofile(path)
    return at


def train_dp2(rank: int, port: int, root: str, data_dir: str) -> dict:
    """DP2 through the real Trainer; returns the error each rank stopped with."""
    from moe_train.trainer.loop import Trainer

    h.worker_env(rank, 2, port)
    cfg = small_config(Path(root), steps=2, eval_interval=0, save_interval=0, log_interval=1, device="cpu", threads=1)
    cfg.data.path = data_dir
    cfg.parallel.dp = 2
    cfg.parallel.collective_timeout_s = 30.0  # a rank left waiting fails in 30 s, not 30 minutes
    cfg.train.micro_batch_size = 2
    trainer = Trainer(cfg)
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - the parent checks which
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}
