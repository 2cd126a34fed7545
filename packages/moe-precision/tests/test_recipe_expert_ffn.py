"""The recipe owns the expert FFN's GEMMs (the seam an MXFP8 recipe replaces): expert_ffn and fused_moe_ffn give
moe-kernels' swiglu_experts / moe_ffn on the weights as gemm_weight casts them, forward and every gradient, in fp32
and under bf16 autocast; a subclass's gemm_weight is what they use."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_kernels import build_route_map, moe_ffn, permute, swiglu_experts

from moe_precision import PrecisionRecipe

T, D, H, E, K = 13, 16, 8, 5, 2


def operands(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    w1 = torch.randn(E, D, 2 * H, generator=g).mul_(0.2).requires_grad_()
    w2 = torch.randn(E, H, D, generator=g).mul_(0.2).requires_grad_()
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 stays empty
    weights = torch.rand(T, K, generator=g).requires_grad_()
    return x, w1, w2, ids, weights


def grads(out, *tensors):
    return torch.autograd.grad(out.float().square().sum(), tensors, retain_graph=True)


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_moe_ffn_and_expert_ffn_are_moe_kernels_on_the_cast_weights(autocast):
    recipe = PrecisionRecipe("bf16")
    x, w1, w2, ids, weights = operands(0)
    route_map = build_route_map(ids, E)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        rows = x.to(recipe.expert_gemm_dtype(x))
        ours = recipe.fused_moe_ffn(rows, route_map, weights, w1, w2, "auto")
        ref = moe_ffn(rows, route_map, weights, recipe.gemm_weight(w1, x), recipe.gemm_weight(w2, x), "auto")
        assert ours.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert torch.equal(ours, ref)
        for a, b in zip(grads(ours, x, w1, w2, weights), grads(ref, x, w1, w2, weights)):
            assert torch.equal(a, b)
        sorted_rows = permute(rows, route_map)
        ours = recipe.expert_ffn(sorted_rows, w1, w2, route_map.offsets, "auto")
        ref = swiglu_experts(sorted_rows, recipe.gemm_weight(w1, sorted_rows), recipe.gemm_weight(w2, sorted_rows),
                             route_map.offsets, "auto")
        assert torch.equal(ours, ref)
        for a, b in zip(grads(ours, x, w1, w2), grads(ref, x, w1, w2)):
            assert torch.equal(a, b)


def test_a_subclass_gemm_weight_is_what_the_expert_gemms_consume():
    @dataclasses.dataclass(frozen=True)
    class Halved(PrecisionRecipe):
        def gemm_weight(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return w * 0.5

    x, w1, w2, ids, weights = operands(1)
    route_map = build_route_map(ids, E)
    with torch.no_grad():
        ours = Halved().fused_moe_ffn(x, route_map, weights, w1, w2, "auto")
        ref = moe_ffn(x, route_map, weights, w1 * 0.5, w2 * 0.5, "auto")
        plain = PrecisionRecipe().fused_moe_ffn(x, route_map, weights, w1, w2, "auto")
    assert torch.equal(ours, ref) and not torch.equal(ours, plain)
