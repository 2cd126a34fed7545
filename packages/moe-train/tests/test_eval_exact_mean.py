"""The eval loss is the exact token-weighted mean of its batches' losses, also past 2^24 scored targets (float32
sums round the target count there)."""

from __future__ import annotations

import contextlib
from fractions import Fraction

import torch
from torch import nn

from moe_train.model.transformer import IGNORED_TARGET
from moe_train.trainer.evaluation import mean_eval_loss
from moe_train.trainer.runtime import LocalRuntime


class ConstantLossModel(nn.Module):
    """A model whose mean cross-entropy on a batch is the batch's first input id (a float the test picks)."""

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.flatten()[0].float(), torch.zeros(())


def test_the_eval_mean_is_exact_past_2_to_the_24_scored_targets():
    big = torch.zeros(1 << 24, dtype=torch.int64)  # 2^24 scored targets at loss 1
    small = torch.full((2,), IGNORED_TARGET, dtype=torch.int64)
    small[0] = 0  # one scored target at loss 3
    batches = [(torch.tensor([1]), big), (torch.tensor([3]), small)]
    got = mean_eval_loss(ConstantLossModel(), batches, LocalRuntime(None, torch.device("cpu")), contextlib.nullcontext)
    exact = Fraction((1 << 24) * 1 + 3, (1 << 24) + 1)
    assert got == float(exact), (got, float(exact))  # float32 sums gave (2^24 + 4) / 2^24
