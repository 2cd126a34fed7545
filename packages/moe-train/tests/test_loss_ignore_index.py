"""Transformer.loss leaves targets of -100 out of its mean (as its docstring says): a guard on the documented
behaviour, checked against a mean taken by hand over the other positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_train.config import ModelConfig
from moe_train.model import Transformer


def test_targets_of_minus_100_are_left_out_of_the_mean():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                    dense_hidden=32, num_experts=4, expert_hidden=16)).double()
    x, y = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))
    y[0, :4], y[2, 6] = -100, -100
    ce, _ = model.loss(x, y)
    logits, _ = model(x)
    keep = y != -100
    by_hand = F.cross_entropy(logits[keep], y[keep], reduction="sum") / keep.sum()
    assert torch.allclose(ce, by_hand, rtol=1e-12, atol=0)
    y[1, 2] = -5
    with pytest.raises(IndexError, match="Target -5 is out of bounds"):
        model.loss(x, y)
