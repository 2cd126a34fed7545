"""The eval loss: every eval window once, the data-parallel ranks sharing them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from moe_train.model.transformer import IGNORED_TARGET
from moe_train.trainer.runtime import Runtime


@torch.no_grad()
def mean_eval_loss(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], runtime: Runtime,
                   amp: Callable[[], AbstractContextManager]) -> float:
    """The token-weighted mean loss over `batches`: data-parallel rank r takes batches r, r+dp, ... and the sums
    meet in one all-reduce, so every rank returns the same value. Every rank runs the same number of forwards
    (expert parallelism exchanges rows in each); a rank with no batch left repeats one (its first, or batch
    dp_rank % batches) and counts nothing. `amp()` is the autocast context of the training forwards."""
    device = runtime.device
    rounds = -(-len(batches) // runtime.dp_size)
    # sum of batch-mean losses x scored targets, scored targets: float64, so the count stays exact past 2^24 targets
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    # random routing draws from a copy of the generators here: how often a run evaluates leaves its training
    # draws, losses and weights as they are
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda"):
        for i in range(rounds):
            index = runtime.dp_rank + i * runtime.dp_size
            x, y = batches[index] if index < len(batches) else batches[runtime.dp_rank % len(batches)]
            y = y.to(device)
            with amp():
                ce, _ = model.loss(x.to(device), y)
            if index < len(batches):
                # weighted by the targets the batch scores (a -100 target is left out of ce's mean), so the result
                # is the token-weighted mean whatever the batching; a batch of only -100 (ce NaN) adds nothing
                scored = (y != IGNORED_TARGET).sum().double()
                total[0] += torch.where(scored > 0, ce.double() * scored, 0.0)
                total[1] += scored
    model.train()
    total = runtime.all_reduce_sum(total).tolist()
    return total[0] / total[1] if total[1] else float("nan")
