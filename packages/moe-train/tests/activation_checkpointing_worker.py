"""Spawned ranks of test_activation_checkpointing.py (importable by name, so child processes can unpickle them).

Four ranks train the shrunk tiny preset for a few steps with each train.activation_checkpointing mode:
dp=4 with ep=2 (two replicas of a two-rank expert group: DP2 x EP2), a capacity that drops rows and the
global balancing loss (an all-reduce in the router forward), then the FSDP2 baseline at dp=4."""

from __future__ import annotations

import numpy as np
import torch

import test_parallel_harness as h
from moe_train.config import Config

STEPS = 3
MODES = ("none", "full", "mlp")


def dp2_ep2(mode: str) -> Config:
    cfg = h.shrunk_tiny(4, 2)
    cfg.model.router.expert_bias = True
    cfg.parallel.expert_capacity_factor = 1.0  # rows past T*k received rows are dropped
    cfg.train.steps, cfg.train.activation_checkpointing = STEPS, mode
    return cfg


def fsdp(mode: str) -> Config:
    cfg = h.shrunk_tiny(4, 1, strategy="fsdp")
    cfg.train.steps, cfg.train.save_interval, cfg.train.activation_checkpointing = STEPS, 0, mode
    return cfg


def _run(cfg: Config, tokens: np.ndarray) -> dict:
    from moe_train.trainer.launch import make_runtime

    rt = make_runtime(cfg, torch.device("cpu"))
    res = h.train(cfg, rt, tokens)
    model = res["model"]
    # every training forward's router sums (h.train never takes them): loads, probabilities, dropped rows
    stats = [router.take_stats() for _, router in model.routers()]
    return {"losses": res["losses"], "norms": res["norms"], "weights": h.global_weights(rt, model), "stats": stats,
            "recompute": [block.recompute for block in model.blocks]}


def worker4(rank: int, port: int, tokens: np.ndarray) -> dict:
    h.worker_env(rank, 4, port)
    out = {f"ep_{mode}": _run(dp2_ep2(mode), tokens) for mode in MODES}
    out.update({f"fsdp_{mode}": _run(fsdp(mode), tokens) for mode in ("none", "full")})
    torch.distributed.destroy_process_group()
    return out
