"""Spawned ranks of test_qa140_document_masking.py (importable by name, so child processes can unpickle them).

Two gloo ranks train the shrunk tiny preset with the document mask for a few steps: DDP at dp=2, DDP at dp=2 x
ep=2, and the FSDP2 baseline at dp=2 with train.loss_chunk_tokens (Transformer.loss_terms a registered forward
method). The test compares each with one process on the same global batch."""

from __future__ import annotations

import numpy as np
import torch

import test_parallel_harness as h
from moe_train.config import Config

EOS = 7
STEPS = 4
CHUNK = 5


def token_stream() -> np.ndarray:
    """The harness's learnable stream with a document end every 5 tokens (several per 16-token window)."""
    tokens = h.token_stream()
    tokens[tokens == EOS] = EOS + 1
    tokens[::5] = EOS
    return tokens


def layout(name: str) -> Config:
    cfg = {"one": lambda: h.shrunk_tiny(1, 1), "dp2": lambda: h.shrunk_tiny(2, 1),
           "dp2_ep2": lambda: h.shrunk_tiny(2, 2), "fsdp_chunk": lambda: h.shrunk_tiny(2, 1, strategy="fsdp")}[name]()
    cfg.train.steps, cfg.train.save_interval, cfg.train.document_masking = STEPS, 0, True
    if name == "fsdp_chunk":
        cfg.train.loss_chunk_tokens = CHUNK
    return cfg


def run(cfg: Config, runtime, tokens: np.ndarray, eos_id: int | None) -> dict:  # noqa: ANN001
    """The harness's loop with the model masked as the Trainer masks it (set_document_masking after setup)."""
    setup = runtime.setup

    def masked_setup(model):  # noqa: ANN001, ANN202
        model = setup(model)
        model.set_document_masking(eos_id)
        return model

    runtime.setup = masked_setup
    res = h.train(cfg, runtime, tokens)
    return {"losses": res["losses"], "weights": h.global_weights(runtime, res["model"]),
            "eos_id": res["model"].document_eos_id}


def worker2(rank: int, port: int, tokens: np.ndarray) -> dict:
    from moe_train.trainer.launch import make_runtime

    h.worker_env(rank, 2, port)
    out = {}
    for name in ("dp2", "dp2_ep2", "fsdp_chunk"):
        cfg = layout(name)
        out[name] = run(cfg, make_runtime(cfg, torch.device("cpu")), tokens, EOS)
    torch.distributed.destroy_process_group()
    return out
