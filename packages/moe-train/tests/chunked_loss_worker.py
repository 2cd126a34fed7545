"""Spawned ranks of test_chunked_loss_parallel.py (importable by name, so child processes can unpickle them).

Two ranks train the shrunk tiny preset for a few steps with train.loss_chunk_tokens 0 and > 0: the FSDP2 baseline
at dp=2 (Transformer.loss_terms runs as a registered forward method, so the root's parameters are gathered for the
chunked head) and DDP at dp=2, ep=2 with tied embeddings (the head's gradient joins the embedding's); and each of
those again with the LM head's z-loss (train.lm_z_loss_weight), whose gradient the chunked head folds into the
cross-entropy's."""

from __future__ import annotations

import numpy as np
import torch

import test_parallel_harness as h
from moe_train.config import Config

STEPS = 3
CHUNK = 5  # 64 tokens a micro-batch per rank: 13 chunks, the last one of 4
Z_WEIGHT = 0.05  # large enough for its gradient to move the weights well past the tolerances


def layout(name: str, chunk: int, z_weight: float = 0.0) -> Config:
    cfg = h.shrunk_tiny(2, 2) if name == "ep" else h.shrunk_tiny(2, 1, strategy="fsdp")
    cfg.model.tie_embeddings = name == "ep"
    cfg.train.steps, cfg.train.save_interval, cfg.train.loss_chunk_tokens = STEPS, 0, chunk
    cfg.train.lm_z_loss_weight = z_weight
    return cfg


def _run(cfg: Config, tokens: np.ndarray) -> dict:
    from moe_train.trainer.launch import make_runtime

    rt = make_runtime(cfg, torch.device("cpu"))
    res = h.train(cfg, rt, tokens)
    return {"losses": res["losses"], "norms": res["norms"], "weights": h.global_weights(rt, res["model"]),
            "chunk": res["model"].loss_chunk_tokens, "z_weight": res["model"].lm_z_loss_weight}


def worker2(rank: int, port: int, tokens: np.ndarray) -> dict:
    h.worker_env(rank, 2, port)
    out = {f"{name}_{chunk}{'_z' if z else ''}": _run(layout(name, chunk, z), tokens)
           for name in ("fsdp", "ep") for chunk in (0, CHUNK) for z in (0.0, Z_WEIGHT)}
    torch.distributed.destroy_process_group()
    return out
