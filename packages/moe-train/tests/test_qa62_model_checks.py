"""QA 62: a model built from a bad ModelConfig is refused naming the field and value before anything is allocated;
a float64 model computes its fp32 pieces (norms, router, rotary, loss) in float64."""

from __future__ import annotations

import math

import pytest
import torch

from moe_train.config import ConfigError, ModelConfig, RouterConfig
from moe_train.model import Router, Transformer
from moe_train.model.layers import RMSNorm
from moe_train.model.rope import apply_rope, rope_tables


def _tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, dense_hidden=8,
                num_experts=2, expert_hidden=8)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("fields,message", [
    (dict(d_model=30, num_heads=4, num_kv_heads=2), "model.num_heads=4: expected a divisor of model.d_model=30"),
    (dict(d_model=24, num_heads=6, num_kv_heads=4), "model.num_kv_heads=4: expected a divisor of model.num_heads=6"),
    (dict(d_model=16, num_heads=2, num_kv_heads=4), "model.num_kv_heads=4: expected a divisor of model.num_heads=2"),
    (dict(d_model=24, num_heads=4, num_kv_heads=2, rotary_fraction=0.5), "model.rotary_fraction=0.5"),
    (dict(d_model=20, num_heads=4, num_kv_heads=2), "model.head_dim=5: expected an even number"),
    (dict(router=RouterConfig(top_k=3)), "model.router.top_k=3: expected 1 <= top_k <= model.num_experts=2"),
    (dict(dense_layers=[5]), "model.dense_layers=[5]: expected indices in [0, 2)"),
    (dict(num_heads=0), "model.num_heads=0: expected a positive integer"),
    (dict(shared_expert_gate=True), "model.shared_expert_gate=True"),
])
def test_a_bad_model_config_is_refused_at_construction_naming_the_field(fields, message):
    """Before: an odd rotary dim, more kv heads than heads or a dense layer past the last ran silently; the others
    failed inside a forward with a shape error ("The size of tensor a (7) must match ...", "selected index k out of
    range") or a ZeroDivisionError."""
    with pytest.raises(ConfigError) as err:
        Transformer(_tiny(**fields), device="meta")
    assert message in str(err.value)


def test_a_float64_model_normalises_routes_rotates_and_takes_its_loss_in_float64():
    """Before: RMSNorm, the router logits, the rotary tables and arithmetic and the cross-entropy ran in fp32 even
    for a float64 model (errors ~1e-7, and a float32 loss), so a float64 model could not serve as a reference."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, generator=g) * 3
    norm = RMSNorm(7, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(7, dtype=torch.float64, generator=g))
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expect, rtol=1e-14, atol=1e-14)

    router = Router(7, 4, RouterConfig(top_k=2, normalize_top_k=False)).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 7, dtype=torch.float64, generator=g))
    out = router(x)
    probs = (x @ router.weight.T).softmax(-1)
    assert out.weights.dtype == torch.float64 and out.aux_loss.dtype == torch.float64
    torch.testing.assert_close(out.weights, probs.gather(1, out.expert_ids), rtol=1e-14, atol=1e-15)

    s, rd = 37, 6
    cos, sin = rope_tables(s, rd, 10_000.0, torch.device("cpu"), torch.float64)
    q = torch.randn(1, 1, s, rd, dtype=torch.float64, generator=g)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * 10_000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    turned = torch.complex(q[..., : rd // 2], q[..., rd // 2:]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(apply_rope(q, cos, sin), torch.cat([turned.real, turned.imag], -1),
                               rtol=1e-13, atol=1e-13)

    model = Transformer(_tiny(num_heads=2, num_kv_heads=2, router=RouterConfig(top_k=2))).double()
    tokens = torch.randint(0, 11, (2, 3), generator=g)
    ce, aux = model.loss(tokens, tokens)
    assert ce.dtype == torch.float64 and aux.dtype == torch.float64
    logits, _ = model(tokens)
    expect_ce = (logits.logsumexp(-1) - logits.gather(-1, tokens[..., None])[..., 0]).mean()
    assert math.isclose(float(ce), float(expect_ce), rel_tol=1e-14)


def test_a_float32_model_keeps_its_rotary_tables_and_loss_in_float32():
    model = Transformer(_tiny(num_heads=2, num_kv_heads=2))
    tokens = torch.randint(0, 11, (1, 4))
    ce, aux = model.loss(tokens, tokens)
    assert ce.dtype == torch.float32 and aux.dtype == torch.float32
    cos, sin = model._rope_cache[2:]
    assert cos.dtype == sin.dtype == torch.float32
