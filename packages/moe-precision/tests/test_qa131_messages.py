"""QA 131: the recipe's expert FFN names an argument that is not a tensor, in moe-kernels' own words. The weights are
cast (reading the rows' dtype) before moe-kernels checks its arguments, so a None or a numpy array failed there with
"AttributeError: 'NoneType' object has no attribute 'dtype'", naming no argument."""

from __future__ import annotations

import pytest
import torch
from moe_kernels import build_route_map
from moe_precision import PrecisionRecipe

T, D, H, E = 6, 4, 3, 3


def operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    w1, w2 = torch.randn(E, D, 2 * H, generator=g), torch.randn(E, H, D, generator=g)
    route_map = build_route_map(torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]]), E)
    return x, w1, w2, route_map, torch.rand(T, 2, generator=g)


@pytest.mark.parametrize("which, want", [
    (0, r"^rows must be a torch.Tensor \[N, d\], got NoneType$"),
    (1, r"^w_gate_up must be a torch.Tensor \[E, d, 2h\], got ndarray$"),
    (2, r"^w_down must be a torch.Tensor \[E, h, d\], got NoneType$"),
])
def test_expert_ffn_names_the_argument_that_is_not_a_tensor(which, want):
    x, w1, w2, route_map, _ = operands()
    args = [x, w1, w2]
    args[which] = w1.numpy() if which == 1 else None
    with pytest.raises(TypeError, match=want):
        PrecisionRecipe().expert_ffn(*args, route_map.offsets)


@pytest.mark.parametrize("which, want", [
    (0, r"^x must be a torch.Tensor \[T, d\], got NoneType$"),
    (3, r"^w_gate_up must be a torch.Tensor \[E, d, 2h\], got NoneType$"),
    (4, r"^w_down must be a torch.Tensor \[E, h, d\], got ndarray$"),
])
def test_fused_moe_ffn_names_the_argument_that_is_not_a_tensor(which, want):
    x, w1, w2, route_map, weights = operands()
    args = [x, route_map, weights, w1, w2]
    args[which] = w2.numpy() if which == 4 else None
    with pytest.raises(TypeError, match=want):
        PrecisionRecipe().fused_moe_ffn(*args)


def test_the_checks_leave_tensors_alone():
    x, w1, w2, route_map, weights = operands()
    assert PrecisionRecipe().fused_moe_ffn(x, route_map, weights, w1, w2).shape == (T, D)
    rows = x[route_map.source_token]
    assert PrecisionRecipe().expert_ffn(rows, w1, w2, route_map.offsets).shape == (T * 2, D)
