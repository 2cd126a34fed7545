"""QA 50: how the recipe's modules pick a GEMM dtype under autocast for float64 tensors.

autocast leaves float64 tensors in float64 (nn.Linear of an fp64 model keeps running in fp64 under
autocast), but the recipe's linear cast its fp64 weight to the autocast dtype while the input stayed
fp64: a dtype-mismatch RuntimeError where the nn.Linear it stands in for runs.
"""

import torch

from moe_precision import PrecisionRecipe


def test_recipe_linear_in_float64_runs_under_autocast_as_nn_linear_does():
    torch.manual_seed(0)
    lin = PrecisionRecipe("bf16").linear(16, 8, bias=True).double()
    ref = torch.nn.Linear(16, 8, bias=True).double()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = lin(x), ref(x)
    assert y.dtype == y_ref.dtype == torch.float64 and torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad)


def test_expert_gemm_dtype_keeps_float64_under_autocast_and_casts_fp32():
    recipe = PrecisionRecipe("bf16")
    w = torch.randn(2, 16, 6, dtype=torch.float64, requires_grad=True)
    x64, x32 = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert recipe.expert_gemm_dtype(x64) == torch.float64 and recipe.gemm_weight(w, x64) is w
        assert recipe.expert_gemm_dtype(x32) == torch.bfloat16  # fp32 activations: the autocast dtype, as before
        assert recipe.gemm_weight(w, x32).dtype == torch.bfloat16
