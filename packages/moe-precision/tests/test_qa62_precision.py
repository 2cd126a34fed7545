"""QA 62: the recipe's linear and expert-weight casts on the CPU paths, on odd and empty shapes, against torch's own
(nn.Linear under autocast, `.to()`): same values and dtypes, gradients landing in the fp32 masters."""

import pytest
import torch

from moe_precision import PrecisionRecipe
from moe_precision.cast import cast_weight, upcast


@pytest.mark.parametrize("lead,fan_in,fan_out,bias,autocast_dtype,x_dtype", [
    ((3,), 7, 5, True, torch.bfloat16, torch.float32),
    ((2, 3), 7, 5, False, torch.bfloat16, torch.float32),
    ((0,), 7, 5, True, torch.bfloat16, torch.float32),  # an empty batch
    ((3,), 1, 1, True, torch.float16, torch.float32),  # fp16 autocast, 1x1 weight
    ((4,), 7, 5, True, torch.bfloat16, torch.bfloat16),  # rows already bf16
    ((4,), 7, 5, True, torch.float16, torch.bfloat16),  # bf16 rows under fp16 autocast
])
def test_recipe_linear_is_nn_linear_bit_for_bit_under_autocast_on_odd_shapes(lead, fan_in, fan_out, bias,
                                                                              autocast_dtype, x_dtype):
    torch.manual_seed(0)
    lin = PrecisionRecipe("bf16").linear(fan_in, fan_out, bias=bias)
    ref = torch.nn.Linear(fan_in, fan_out, bias=bias)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(*lead, fan_in).to(x_dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype):
        y, y_ref = lin(x1), ref(x2)
    assert y.dtype == y_ref.dtype == autocast_dtype and torch.equal(y, y_ref)
    gy = torch.randn(y.shape).to(y.dtype)
    y.backward(gy)
    y_ref.backward(gy)
    assert lin.weight.grad.dtype == torch.float32 and torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(x1.grad, x2.grad) and x1.grad.dtype == x_dtype
    if bias:
        assert lin.bias.grad.dtype == torch.float32 and torch.equal(lin.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("shape", [(3, 5, 6), (1, 1, 2), (0, 4, 6), (2, 0, 6), (4, 3, 0)])
def test_expert_weight_cast_and_its_gradient_match_to_on_odd_and_empty_shapes(shape):
    recipe = PrecisionRecipe("bf16")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g).requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    x = torch.randn(2, shape[1], generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert recipe.expert_gemm_dtype(x) == torch.bfloat16
        out = recipe.gemm_weight(w, x)
    ref = w_ref.to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    gy = torch.randn(shape, generator=g).bfloat16()
    out.backward(gy)
    ref.backward(gy)
    assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape and torch.equal(w.grad, w_ref.grad)
    # outside autocast the fp32 master is the GEMM weight itself
    assert recipe.gemm_weight(w, x) is w and recipe.expert_gemm_dtype(x) == torch.float32


def test_a_transposed_master_gets_its_gradient_in_its_own_layout_and_accumulates_over_two_uses():
    w = torch.randn(6, 4).t().requires_grad_()  # [4, 6], strides (1, 4)
    g1, g2 = torch.randn(4, 6).bfloat16(), torch.randn(4, 6).t().contiguous().t().bfloat16()
    (cast_weight(w, torch.bfloat16) * g1.float()).sum().backward()
    cast_weight(w, torch.bfloat16).backward(g2)
    # the first product's gradient is g1 rounded to bf16 (the product ran in fp32 on the bf16 weight)
    torch.testing.assert_close(w.grad, g1.float() + g2.float(), rtol=0, atol=0)
    assert w.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_on_the_cpu_is_to_and_returns_a_new_tensor(dtype):
    t = (torch.randn(7, 3) * 1e3).to(dtype)[:, ::2]  # odd, not contiguous
    out = upcast(t, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, t.float()) and out.data_ptr() != t.data_ptr()
    same = torch.randn(5)
    assert torch.equal(upcast(same, torch.float32), same)
