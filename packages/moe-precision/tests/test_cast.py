"""cast_weight / upcast: the GEMM weight cast and its gradient cast back, against torch's `.to()`."""

import pytest
import torch

from moe_precision import PrecisionRecipe
from moe_precision.cast import cast_weight, upcast

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cast_weight_forward_and_gradient_match_to():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 7, 3, generator=g, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    out, ref = cast_weight(w, torch.bfloat16), w_ref.to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    gy = torch.randn(5, 7, 3, generator=g).bfloat16()
    out.backward(gy)
    ref.backward(gy)
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, w_ref.grad)


def test_cast_weight_is_the_weight_itself_when_already_in_the_gemm_dtype():
    w = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    assert cast_weight(w, torch.bfloat16) is w


def test_recipe_linear_keeps_nn_linear_parameters_and_matches_it_under_autocast():
    torch.manual_seed(0)
    lin = PrecisionRecipe("bf16").linear(16, 8, bias=True)
    ref = torch.nn.Linear(16, 8, bias=True)
    ref.load_state_dict(lin.state_dict())
    assert isinstance(lin, torch.nn.Linear) and list(lin.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 16)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, y_ref = lin(x), ref(x)
        assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
        y.float().sum().backward()
        y_ref.float().sum().backward()
        assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)
        lin.zero_grad()
        ref.zero_grad()


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 3 * 1024 * 1024 + 5])
def test_upcast_kernel_is_exactly_to_float32_on_gpu(dtype, n):
    t = (torch.randn(n, device="cuda") * 1e3).to(dtype)
    t[0] = float("inf") if n > 1 else t[0]
    out = upcast(t, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, t.float())
    strided = t[::2]  # not contiguous: torch's cast
    assert torch.equal(upcast(strided, torch.float32), strided.float())


def test_recipe_modules_run_shape_only_forwards_on_meta_tensors():
    """nn.Linear runs on meta tensors (shape inference); so must the recipe's linear and expert weights
    (meta has no autocast to ask)."""
    recipe = PrecisionRecipe("bf16")
    lin = recipe.linear(16, 8).to("meta")
    x = torch.empty(3, 16, device="meta")
    assert lin(x).shape == (3, 8) and lin(x).device.type == "meta"
    w = torch.empty(4, 16, 6, device="meta", requires_grad=True)
    assert recipe.gemm_weight(w, x).dtype == torch.float32 and recipe.expert_gemm_dtype(x) == torch.float32
