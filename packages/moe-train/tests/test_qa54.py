"""QA 54: the router's math against references written here from the published definitions.

Gating (softmax; sigmoid as DeepSeek-V3 / GLM-4.5), top-k on scores + a selection-only bias, renormalised
weights times routed_scaling_factor; the balancing loss E * sum_i f_i P_i (Switch / OLMoE, f over the T*k
routed rows, P the mean probability, sigmoid scores normalised per token as DeepSeek-V3's balance loss);
the router z-loss mean(logsumexp(logits)^2) (ST-MoE); the health numbers metrics.jsonl reports; the
aux-loss-free bias update b += rate * sign(mean load - load); fp32 logits under bf16 autocast (README).
"""

import math

import pytest
import torch

from moe_train.config import RouterConfig
from moe_train.model.router import Router

E, D, T = 7, 12, 48


def reference_router(x, w, bias, k, gating, normalize, scale):
    """Everything in float64, by the definitions: ids [T, k] (best first), weights, lb, z, f, P, margin."""
    logits = x.double() @ w.double().T
    if gating == "softmax":
        s = torch.exp(logits - logits.max(-1, keepdim=True).values)
        s = s / s.sum(-1, keepdim=True)
    else:
        s = 1 / (1 + torch.exp(-logits))
    sel = s.detach() + (bias.double() if bias is not None else 0.0)
    ranked = torch.sort(sel, -1, descending=True)
    ids = ranked.indices[:, :k]
    weights = torch.stack([s[t, ids[t]] for t in range(x.shape[0])])
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * scale
    f = torch.zeros(E, dtype=torch.float64)
    for row in ids.tolist():
        for i in row:
            f[i] += 1
    f = f / (x.shape[0] * k)
    p = s if gating == "softmax" else s / s.sum(-1, keepdim=True)
    lb = E * (f * p.mean(0)).sum()
    z = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    margin = (ranked.values[:, k - 1] - ranked.values[:, k]).mean() if k < E else torch.zeros(())
    return ids, weights, lb, z, f, p.mean(0), margin


@pytest.mark.parametrize("gating,normalize,scale,use_bias,k", [
    ("softmax", True, 1.0, False, 2), ("softmax", False, 1.0, True, 3), ("softmax", True, 2.5, False, 1),
    ("sigmoid", True, 2.5, True, 3), ("sigmoid", False, 1.0, False, 2), ("sigmoid", True, 1.0, True, E),
])
def test_router_outputs_losses_gradients_and_health_match_the_published_definitions(gating, normalize, scale,
                                                                                      use_bias, k):
    torch.manual_seed(54)
    lbw, zw = 0.3, 0.07
    cfg = RouterConfig(gating=gating, top_k=k, normalize_top_k=normalize, routed_scaling_factor=scale,
                       expert_bias=use_bias, lb_loss_weight=lbw, z_loss_weight=zw)
    router = Router(D, E, cfg)
    torch.nn.init.normal_(router.weight, std=0.7)
    if use_bias:
        router.expert_bias.copy_(torch.randn(E) * 0.3)
    x = torch.randn(T, D, requires_grad=True)
    out = router(x)
    w_ref = router.weight.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    ids, weights, lb, z, f, p, margin = reference_router(x_ref, w_ref, router.expert_bias if use_bias else None,
                                                         k, gating, normalize, scale)
    assert torch.equal(out.expert_ids, ids)
    torch.testing.assert_close(out.weights.double(), weights, rtol=1e-5, atol=1e-6)
    aux = lbw * lb + zw * z
    torch.testing.assert_close(out.aux_loss.double(), aux, rtol=1e-5, atol=1e-6)
    # gradients of the losses (f is a count: no gradient; P and z carry it) and of the weights
    g = torch.randn(T, k, dtype=torch.float64)
    got = torch.autograd.grad(out.aux_loss + (out.weights * g.float()).sum(), [router.weight, x])
    want = torch.autograd.grad(aux + (weights * g).sum(), [w_ref, x_ref])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-6)
    h = router.pop_health()
    load = f * T * k
    assert h["tokens"] == T
    assert max(abs(a - b) for a, b in zip(h["f"], f.tolist())) < 1e-5
    assert max(abs(a - b) for a, b in zip(h["P"], p.tolist())) < 1e-5
    assert math.isclose(h["max_over_mean_load"], float(load.max() / load.mean()), rel_tol=1e-9)
    assert h["dead_experts"] == int((load == 0).sum())
    assert math.isclose(h["topk_margin"], float(margin), abs_tol=1e-6)
    assert math.isclose(h["lb_loss"], lb.item(), rel_tol=1e-5) and math.isclose(h["z_loss"], z.item(), rel_tol=1e-5)
    # aux-loss-free balancing: b += rate * sign(mean load - load), from the load routed since the last update
    before = router.expert_bias.clone()
    router.cfg.expert_bias_rate = 0.01
    router.update_expert_bias()
    if use_bias:
        torch.testing.assert_close(router.expert_bias, before + 0.01 * torch.sign(load.mean() - load).float())
    else:
        assert torch.equal(router.expert_bias, before)
    assert torch.all(router.step_load == 0)


def test_a_perfectly_balanced_router_has_a_balancing_loss_of_exactly_one_times_its_weight():
    # uniform routing spreads the T*k rows evenly; zero logits make P uniform: E * sum (1/E)(1/E) = 1, not k
    router = Router(D, 6, RouterConfig(top_k=3, routing="uniform", lb_loss_weight=0.25, z_loss_weight=0.0))
    torch.nn.init.zeros_(router.weight)
    assert math.isclose(router(torch.randn(30, D)).aux_loss.item(), 0.25, rel_tol=1e-6)


@pytest.mark.parametrize("gating,use_bias", [("softmax", False), ("sigmoid", True)])
def test_router_logits_stay_fp32_under_bf16_autocast(gating, use_bias):
    """README: "The router computes fp32 logits". Under torch.autocast (the trainer's bf16 on GPU) F.linear
    ran in bf16 whatever the .float() casts: the weights, the top-k choice and both losses moved by bf16
    rounding. CPU autocast casts F.linear the same way, so the check runs here."""
    torch.manual_seed(5)
    cfg = RouterConfig(gating=gating, top_k=2, expert_bias=use_bias, lb_loss_weight=0.1, z_loss_weight=0.01)
    router = Router(64, E, cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(512, 64)
    want = router(x)
    want_grad = torch.autograd.grad(want.aux_loss + want.weights.sum(), router.weight)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
        got_bf16_input = router(x.bfloat16())
    got_grad = torch.autograd.grad(got.aux_loss + got.weights.sum(), router.weight)[0]
    assert torch.equal(got.expert_ids, want.expert_ids)
    torch.testing.assert_close(got.weights.float(), want.weights, rtol=1e-6, atol=1e-7)
    assert got.weights.dtype == torch.float32
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    # a bf16 input is widened, not the weight narrowed: the same as the fp32 forward of that input
    plain = router(x.bfloat16())
    torch.testing.assert_close(got_bf16_input.weights, plain.weights, rtol=1e-6, atol=1e-7)
