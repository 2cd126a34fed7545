"""QA 131: Transformer.forward names a token id outside the vocabulary (on the CPU, where the check costs no host
read of its own), and tokens that are not a [B, S] tensor. Before: the embedding's "IndexError: index out of range
in self", naming neither the id nor the vocabulary; a [S] tensor failed on "tuple index out of range", a [B, S, 1]
one on "too many values to unpack", a list inside torch's embedding."""

from __future__ import annotations

import re

import pytest
import torch
from moe_train import ModelConfig, RouterConfig, Transformer

V = 64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=16, num_layers=2, num_heads=2, num_kv_heads=2, dense_hidden=16,
                      dense_layers=[0], num_experts=4, expert_hidden=8, router=RouterConfig(top_k=2))
    return Transformer(cfg)


@pytest.mark.parametrize("bad, where", [(V, "tokens[1, 2]=64"), (-1, "tokens[1, 2]=-1"),
                                        (10**6, "tokens[1, 2]=1000000")])
def test_forward_names_a_token_id_outside_the_vocabulary(model, bad, where):
    tokens = torch.randint(0, V, (2, 5))
    tokens[1, 2] = bad
    tokens[1, 4] = bad
    want = f"{where} is outside [0, model.vocab_size=64) (2 ids out of range in all)"
    with pytest.raises(IndexError, match=f"^{re.escape(want)}$"):
        model(tokens)


def test_forward_names_tokens_that_are_not_a_batch_of_sequences(model):
    with pytest.raises(ValueError, match=r"^tokens must be \[B, S\] \(batch, sequence\), got shape \(5,\)$"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^tokens must be \[B, S\] \(batch, sequence\), got shape \(2, 5, 1\)$"):
        model(torch.zeros(2, 5, 1, dtype=torch.long))
    with pytest.raises(TypeError, match=r"^tokens must be a torch.Tensor \[B, S\] of token ids, got list$"):
        model([[1, 2, 3]])


def test_forward_takes_every_id_in_the_vocabulary(model):
    tokens = torch.tensor([[0, V - 1, 5], [V - 1, 0, 1]])
    logits, _ = model(tokens)
    assert logits.shape == (2, 3, V) and torch.isfinite(logits).all()
