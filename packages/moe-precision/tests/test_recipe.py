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
