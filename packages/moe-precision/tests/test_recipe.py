import pytest
import torch

from moe_precision import PrecisionRecipe


def test_bf16_recipe_builds_linear_and_reports_autocast_dtype():
    r = PrecisionRecipe("bf16")
    lin = r.linear(8, 4)
    assert lin.weight.shape == (4, 8) and lin.bias is None
    x = torch.randn(2, 8)
    assert r.expert_gemm_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert r.expert_gemm_dtype(x) == torch.bfloat16


def test_unknown_and_unbuilt_recipes_are_refused_by_name():
    with pytest.raises(ValueError, match="'fp4' is unknown"):
        PrecisionRecipe("fp4")
    with pytest.raises(NotImplementedError, match="'mxfp8' is planned but not built"):
        PrecisionRecipe("mxfp8")


def test_linear_hands_out_the_weight_its_gemm_consumes():
    """Bf16Linear.gemm_weight(x): the weight as forward casts it for x (bf16 under autocast, its own dtype
    otherwise), differentiable into the fp32 weight; forward is F.linear on it."""
    torch.manual_seed(0)
    layer = PrecisionRecipe("bf16").linear(12, 7)
    x = torch.randn(5, 12)
    assert layer.gemm_weight(x).dtype == torch.float32
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.gemm_weight(x)), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = layer.gemm_weight(x)
        assert w.dtype == torch.bfloat16
        torch.testing.assert_close(layer(x), x.to(torch.bfloat16) @ w.T, rtol=0, atol=0)
    (w.float().sum() * 3).backward()
    assert layer.weight.grad.dtype == torch.float32
    torch.testing.assert_close(layer.weight.grad, torch.full_like(layer.weight, 3.0))
