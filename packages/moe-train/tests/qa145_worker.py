"""Spawned ranks of test_qa145_sliding_window_ranks.py (importable by name, so child processes can unpickle them).

Two gloo ranks train the shrunk tiny preset with sliding windows and the document mask: DDP at dp=2, DDP at dp=2 x
ep=2 (also with activation checkpointing and a chunked loss), the FSDP2 baseline at dp=2 and bf16 resident weights
at dp=2 (the harness's loop); then real Trainers (with
eval) resume a one-process windowed checkpoint at dp=2 x ep=2 and at dp=2, and train unbroken at dp=2 x ep=2."""

from __future__ import annotations

import numpy as np
import torch

import layout_resume_worker as lw
import test_parallel_harness as h
from moe_train.config import Config

EOS = 7
STEPS = 3
PATTERN = [3, 0, 6]  # 3 layers: windows 3, full, 6 on 16-token sequences
LAYOUTS = ("dp2", "dp2_ep2", "fsdp", "bf16", "dp2_ep2_recompute_chunks")


def token_stream() -> np.ndarray:
    """The harness's learnable stream with a document end every 11 tokens (longer than the windows)."""
    tokens = h.token_stream()
    tokens[tokens == EOS] = EOS + 1
    tokens[::11] = EOS
    return tokens


def layout(name: str, pattern: list[int] | None = None) -> Config:
    dp, ep, strategy = {"one": (1, 1, "ddp"), "one_bf16": (1, 1, "ddp"), "dp2": (2, 1, "ddp"),
                        "dp2_ep2": (2, 2, "ddp"), "fsdp": (2, 1, "fsdp"), "bf16": (2, 1, "ddp"),
                        "dp2_ep2_recompute_chunks": (2, 2, "ddp")}[name]
    cfg = h.shrunk_tiny(dp, ep, strategy=strategy)
    cfg.model.sliding_window_pattern = list(PATTERN if pattern is None else pattern)
    cfg.train.steps, cfg.train.save_interval, cfg.train.document_masking = STEPS, 0, True
    if name in ("bf16", "one_bf16"):
        cfg.parallel.param_dtype = "bf16"
    if name == "dp2_ep2_recompute_chunks":  # each block recomputed in backward, the loss 5 tokens at a time
        cfg.train.activation_checkpointing, cfg.train.loss_chunk_tokens = "full", 5
    return cfg


def run(cfg: Config, runtime, tokens: np.ndarray, eos_id: int | None) -> dict:  # noqa: ANN001
    setup = runtime.setup

    def masked_setup(model):  # noqa: ANN001, ANN202
        model = setup(model)
        model.set_document_masking(eos_id)
        return model

    runtime.setup = masked_setup
    res = h.train(cfg, runtime, tokens)
    return {"losses": res["losses"], "weights": h.global_weights(runtime, res["model"]),
            "windows": [res["model"].cfg.attention_window(i) for i in range(cfg.model.num_layers)]}


def worker2(rank: int, ports: list[int], tokens: np.ndarray, resumes: list[tuple]) -> dict:
    from moe_train.trainer.launch import make_runtime

    out = {}
    for port, name in zip(ports, LAYOUTS):
        h.worker_env(rank, 2, port)
        cfg = layout(name)
        out[name] = run(cfg, make_runtime(cfg, torch.device("cpu")), tokens, EOS)
        torch.distributed.destroy_process_group()
    for port, cfg in zip(ports[len(LAYOUTS):], resumes):  # their run folders were seeded before the spawn
        h.worker_env(rank, 2, port)
        lw.run_trainer(cfg)
        h.release_process_groups()
    return out
