"""MoELayer, Attention and Router built on their own (outside a Transformer) refuse a bad config by name when they
are built. Before: a top_k larger than the expert count built and then failed in the first forward with torch's
"selected index k out of range"; an attention with num_kv_heads not dividing num_heads, or d_model not divisible
by num_heads, built without a word."""

from __future__ import annotations

import pytest
import torch

from moe_precision import PrecisionRecipe
from moe_train.config import ConfigError, ModelConfig, RouterConfig
from moe_train.model.attention import Attention
from moe_train.model.moe import MoELayer
from moe_train.model.router import Router

BASE = dict(vocab_size=100, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=64, num_experts=4,
            expert_hidden=16)


@pytest.mark.parametrize("overrides,message", [
    (dict(router=RouterConfig(top_k=6)), r"model.router.top_k=6: expected 1 <= top_k <= model.num_experts=4"),
    (dict(expert_hidden=0), r"model.expert_hidden=0: expected a positive integer"),
    (dict(d_model=30), r"model.num_heads=4: expected a divisor of model.d_model=30"),
])
def test_moe_layer_refuses_a_bad_config_when_built(overrides, message):
    with pytest.raises(ConfigError, match=message):
        MoELayer(ModelConfig(**{**BASE, **overrides}), PrecisionRecipe())


@pytest.mark.parametrize("overrides,message", [
    (dict(num_kv_heads=3), r"model.num_kv_heads=3: expected a divisor of model.num_heads=4"),
    (dict(d_model=30), r"model.num_heads=4: expected a divisor of model.d_model=30"),
    (dict(head_dim=6, rotary_fraction=0.5), r"model.rotary_fraction=0.5: .*this one gives 3"),
])
def test_attention_refuses_a_bad_config_when_built(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Attention(ModelConfig(**{**BASE, **overrides}), PrecisionRecipe())


@pytest.mark.parametrize("top_k", [0, 5])
def test_router_refuses_a_top_k_its_experts_cannot_give(top_k):
    with pytest.raises(ConfigError, match=rf"model.router.top_k={top_k}: expected 1 <= top_k <= model.num_experts=4"):
        Router(16, 4, RouterConfig(top_k=top_k))


def test_valid_modules_built_alone_still_run():
    cfg = ModelConfig(**BASE)
    layer = MoELayer(cfg, PrecisionRecipe())
    torch.nn.init.normal_(layer.router.weight, std=0.1)
    torch.nn.init.normal_(layer.experts.w_gate_up, std=0.1)
    torch.nn.init.normal_(layer.experts.w_down, std=0.1)
    out, aux = layer(torch.randn(2, 5, 32))
    assert out.shape == (2, 5, 32) and torch.isfinite(out).all() and aux.shape == ()
    assert Router(16, 4, RouterConfig(top_k=4)).num_experts == 4
    assert Attention(cfg, PrecisionRecipe()).head_dim == 8
