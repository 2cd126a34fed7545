"""Spawned ranks of test_metrics_qa.py (importable by name, so child processes can unpickle them).

Each rank runs the real Trainer and records what the test needs to recount every logged number by hand:
each training forward's router input, weight, expert bias and chosen experts, and each micro-batch's loss."""

from __future__ import annotations

from pathlib import Path

import torch

import test_parallel_harness as h
from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig

E, TOP_K, SEQ, MICRO_BATCH, GRAD_ACCUM, STEPS, LOG_INTERVAL = 4, 2, 16, 2, 2, 4, 2
COLLAPSE_AT = 2  # from this step on, rank 1's expert bias sends all of its tokens to experts 0 and 1
COLLAPSE_BIAS = (1.0, 1.0, 0.0, 0.0)  # probabilities are < 1: these two win every top-2 on rank 1


def two_rank_config(run_dir: Path, data_dir: str) -> Config:
    """DP2 x EP2 (experts 0, 1 on rank 0; 2, 3 on rank 1) with a capacity of exactly T*k received rows."""
    cfg = Config(
        model=ModelConfig(vocab_size=512, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden=64,
                          dense_layers=[0], num_experts=E, expert_hidden=16,
                          router=RouterConfig(top_k=TOP_K, expert_bias=True, expert_bias_rate=0.0)),
        data=DataConfig(path=data_dir, seq_len=SEQ),
        train=TrainConfig(steps=STEPS, micro_batch_size=MICRO_BATCH, grad_accum=GRAD_ACCUM, warmup_steps=1,
                          eval_interval=STEPS, eval_windows=6, log_interval=LOG_INTERVAL, save_interval=0,
                          run_dir=str(run_dir), progress=False, device="cpu", threads=1),
        preset="test",
    )
    cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.expert_capacity_factor = 2, 2, 1.0
    return cfg


def record_routing(model: torch.nn.Module) -> list[dict]:
    """Every training forward of every router, in call order: layer, input x [T, d], weight, bias, chosen ids."""
    calls: list[dict] = []
    for index, router in model.routers():
        def hook(mod, inputs, out, index=index):  # noqa: ANN001, ANN202
            if mod.training:
                calls.append({"layer": index, "x": inputs[0].detach().clone(), "weight": mod.weight.detach().clone(),
                              "bias": mod.expert_bias.detach().clone(), "ids": out.expert_ids.clone()})
        router.register_forward_hook(hook)
    return calls


def record_losses(model: torch.nn.Module) -> list[float]:
    """The cross-entropy of every training micro-batch, in order."""
    losses: list[float] = []
    real = model.loss_terms

    def loss_terms(x, y):  # noqa: ANN001, ANN202
        terms = real(x, y)
        if model.training:
            losses.append(float(terms.ce.detach()))
        return terms
    model.loss_terms = loss_terms
    return losses


def train_two_ranks(rank: int, ports: list[int], root: str, data_dir: str) -> dict:
    """The collapsing DP2 x EP2 run above, then a dropless DP2 x EP2 run of one step (same bias on both ranks)
    whose eval loss every rank reports."""
    from moe_train.trainer import loop
    from moe_train.trainer.loop import Trainer

    h.worker_env(rank, 2, ports[0])
    loop.peak_memory_gib = lambda device: 1.0 + rank  # as CUDA would report it: rank 1 peaks higher
    trainer = Trainer(two_rank_config(Path(root) / "run", data_dir))
    calls, losses = record_routing(trainer.model), record_losses(trainer.model)
    real_step = trainer._train_step

    def step() -> dict:
        if rank == 1 and trainer.step == COLLAPSE_AT:
            for _, router in trainer.model.routers():
                router.expert_bias.copy_(torch.tensor(COLLAPSE_BIAS))
        return real_step()
    trainer._train_step = step
    summary = trainer.train()

    h.worker_env(rank, 2, ports[1])
    cfg = two_rank_config(Path(root) / "dropless", data_dir)
    cfg.parallel.expert_capacity_factor, cfg.train.steps, cfg.train.eval_interval = 0.0, 1, 1
    cfg.train.save_interval = 1  # the test evaluates the saved weights again in one process
    trainer = Trainer(cfg)
    eval_forwards = count_eval_forwards(trainer.model)
    dropless = trainer.train()
    return {"calls": calls, "losses": losses, "summary": summary, "dropless_summary": dropless,
            "eval_forwards": eval_forwards, "dropless_root": str(Path(root) / "dropless")}


def count_eval_forwards(model: torch.nn.Module) -> list[int]:
    """[windows] per forward the model runs in eval mode, in call order."""
    sizes: list[int] = []
    loss = model.loss

    def counted(x, y):  # noqa: ANN001, ANN202
        if not model.training:
            sizes.append(x.shape[0])
        return loss(x, y)
    model.loss = counted
    return sizes
