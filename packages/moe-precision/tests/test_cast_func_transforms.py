"""torch.func (grad, vmap, jvp) and forward-mode AD through the recipe's weight cast, and the rows cast to the expert
GEMMs' dtype (review helper 152: through moe-precision 0.5.1 the cast's autograd Function had no setup_context and no
jvp, so Bf16Linear and the recipe's expert FFN failed under transforms that nn.Linear and moe-kernels alone run; and
fp32 rows under bf16 autocast met bf16 weights)."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, jvp, vmap

from moe_kernels import build_route_map, moe_ffn, permute, swiglu_experts
from moe_precision import PrecisionRecipe
from moe_precision.cast import cast_weight


def linear_pair(seed: int, bias: bool):
    torch.manual_seed(seed)
    ours = PrecisionRecipe().linear(9, 5, bias=bias)
    ref = torch.nn.Linear(9, 5, bias=bias)
    ref.load_state_dict(ours.state_dict())
    return ours, ref, {k: v.detach() for k, v in ours.named_parameters()}


def squared_output(module):
    def loss(params, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return functional_call(module, params, (x,)).float().square().sum()
    return loss


@pytest.mark.parametrize("bias", [False, True])
def test_func_grad_and_per_sample_grads_of_bf16_linear_equal_nn_linear(bias):
    ours, ref, params = linear_pair(1, bias)
    x = torch.randn(7, 9)
    got, want = grad(squared_output(ours))(params, x), grad(squared_output(ref))(params, x)
    assert got.keys() == want.keys() and all(got[k].dtype == torch.float32 for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    per_sample = vmap(grad(squared_output(ours)), in_dims=(None, 0))(params, x.unsqueeze(1))
    per_sample_ref = vmap(grad(squared_output(ref)), in_dims=(None, 0))(params, x.unsqueeze(1))
    for k in want:
        assert per_sample[k].shape == (7, *params[k].shape)
        torch.testing.assert_close(per_sample[k], per_sample_ref[k], rtol=0, atol=0)
        torch.testing.assert_close(per_sample[k].sum(0), got[k], rtol=2e-2, atol=2e-2)  # bf16 GEMMs, summed apart


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_jvp_and_forward_ad_through_cast_weight_are_those_of_to(dtype):
    w, t = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    out, tangent = jvp(lambda a: cast_weight(a, dtype).square(), (w,), (t,))
    want_out, want_tangent = jvp(lambda a: a.to(dtype).square(), (w,), (t,))
    assert out.dtype == tangent.dtype == dtype
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(tangent, want_tangent, rtol=0, atol=0)
    with fwAD.dual_level():
        dual = cast_weight(fwAD.make_dual(w, t), dtype)
        assert fwAD.unpack_dual(dual).tangent.dtype == dtype
        torch.testing.assert_close(fwAD.unpack_dual(dual).tangent, t.to(dtype), rtol=0, atol=0)


def expert_case(seed: int, T: int = 11, D: int = 16, H: int = 8, E: int = 5, K: int = 2):
    """Routes over experts 0, 1, 2, 4: expert 3 gets no rows."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([0, 1, 2, 4])
    ids = torch.stack([used[torch.randperm(4, generator=g)[:K]] for _ in range(T)])
    return (build_route_map(ids, E), torch.randn(T, D, generator=g), torch.rand(T, K, generator=g),
            torch.randn(E, D, 2 * H, generator=g) * 0.2, torch.randn(E, H, D, generator=g) * 0.2)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_func_grad_through_the_recipes_fused_ffn_equals_moe_kernels_on_cast_weights(backend):
    rm, x, rw, w1, w2 = expert_case(2)
    xb, recipe = x.bfloat16(), PrecisionRecipe()

    def ours(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return recipe.fused_moe_ffn(xb, rm, rw, a, b, backend).float().square().sum()

    def theirs(a, b):
        return moe_ffn(xb, rm, rw, a.bfloat16(), b.bfloat16(), backend).float().square().sum()

    got, want = grad(ours, argnums=(0, 1))(w1, w2), grad(theirs, argnums=(0, 1))(w1, w2)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_forward_ad_through_the_recipes_fused_ffn_on_the_reference_backend():
    rm, x, rw, w1, w2 = expert_case(3)
    w1, w2 = w1.double(), w2.double()  # fp64 masters cast to the fp32 rows' dtype: the cast is in the graph
    t1 = torch.randn_like(w1)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(PrecisionRecipe().fused_moe_ffn(x, rm, rw, fwAD.make_dual(w1, t1), w2, "reference"))
        want = fwAD.unpack_dual(moe_ffn(x, rm, rw, fwAD.make_dual(w1.float(), t1.float()), w2.float(), "reference"))
    torch.testing.assert_close(got.primal, want.primal, rtol=0, atol=0)
    torch.testing.assert_close(got.tangent, want.tangent, rtol=0, atol=0)


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.float16])
def test_rows_of_another_dtype_under_autocast_run_in_the_gemm_dtype(rows_dtype):
    """fp32 rows (a dequantising codec's decode) or fp16 ones under bf16 autocast: the recipe casts them as it casts
    the weights; through 0.5.1 moe-kernels refused, naming a bf16 w_gate_up the caller never made."""
    rm, x, rw, w1, w2 = expert_case(4)
    recipe = PrecisionRecipe()
    rows = permute(x, rm).to(rows_dtype).requires_grad_()
    xr = x.to(rows_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert recipe.expert_gemm_dtype(rows) == torch.bfloat16
        y = recipe.expert_ffn(rows, w1, w2, rm.offsets, "reference")
        z = recipe.fused_moe_ffn(xr, rm, rw, w1, w2, "reference")
    assert y.dtype == z.dtype == torch.bfloat16
    torch.testing.assert_close(y, swiglu_experts(rows.detach().bfloat16(), w1.bfloat16(), w2.bfloat16(), rm.offsets,
                                                 "reference"), rtol=0, atol=0)
    torch.testing.assert_close(z, moe_ffn(x.to(rows_dtype).bfloat16(), rm, rw, w1.bfloat16(), w2.bfloat16(),
                                          "reference"), rtol=0, atol=0)
    (y.float().sum() + z.float().sum()).backward()
    assert rows.grad.dtype == xr.grad.dtype == rows_dtype and rows.grad.abs().sum() > 0 and xr.grad.abs().sum() > 0
