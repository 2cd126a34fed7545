"""Training pieces of test_nonfinite_loss.py (importable by name, so spawned ranks can unpickle them).

An infinite loss with finite gradients: a constant +inf added to the cross-entropy of the micro-batches of one
step (on some ranks only). Backward never sees it (a constant has no gradient), so the step's gradients are the
ordinary ones; only the loss says something went wrong.
"""

from __future__ import annotations

from pathlib import Path

import torch

import test_parallel_harness as h
from test_parallel_harness import small_config

POISONED_STEP = 1  # the step (0-based, as trainer.step counts the steps done) whose loss is +inf


def poison_loss(trainer, on_this_rank: bool = True) -> None:  # noqa: ANN001
    """Add +inf to the training loss of POISONED_STEP's micro-batches."""
    real = trainer.model.loss_terms

    def loss_terms(x, y):  # noqa: ANN001, ANN202
        terms = real(x, y)
        if trainer.model.training and trainer.step == POISONED_STEP and on_this_rank:
            terms = terms._replace(ce=terms.ce + torch.tensor(float("inf")))
        return terms
    trainer.model.loss_terms = loss_terms


def record_weights_per_step(trainer) -> list[dict[str, torch.Tensor]]:  # noqa: ANN001
    """The model's weights before the first step and after each step (filled in as train() runs)."""
    snapshots: list[dict[str, torch.Tensor]] = []
    real_step = trainer._train_step

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    def step() -> dict:
        if not snapshots:
            snapshots.append(snapshot())
        out = real_step()
        snapshots.append(snapshot())
        return out
    trainer._train_step = step
    return snapshots


def train_two_ranks(rank: int, port: int, root: str, data_dir: str, ep: int) -> dict:
    """DP2 (x EP ep) through the real Trainer; only rank 1's loss is +inf on POISONED_STEP."""
    from moe_train.trainer.loop import Trainer

    h.worker_env(rank, 2, port)
    cfg = small_config(Path(root), steps=3, eval_interval=0, save_interval=0, log_interval=1, max_skipped_steps=3,
                       device="cpu", threads=1)
    cfg.data.path = data_dir
    cfg.parallel.dp, cfg.parallel.ep = 2, ep
    cfg.train.micro_batch_size = 2
    trainer = Trainer(cfg)
    poison_loss(trainer, on_this_rank=rank == 1)
    snapshots = record_weights_per_step(trainer)
    summary = trainer.train()
    return {"snapshots": snapshots, "summary": summary, "skipped_steps": trainer.skipped_steps}
