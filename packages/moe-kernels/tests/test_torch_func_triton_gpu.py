"""torch.func (grad, vjp, vmap, jacrev) through the triton backend on a CUDA GPU, bf16 and fp32:
the same values as the float64 reference and exactly eager autograd's on the same kernels; a
second derivative and forward-mode AD refused by name.

Run on the device: PYTHONPATH=packages/moe-kernels/src python3 -m pytest -m gpu packages/moe-kernels/tests/test_torch_func_triton_gpu.py
"""

import re

import pytest
import torch

from moe_kernels import build_route_map, combine, grouped_gemm, moe_ffn, permute, swiglu_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

T, D, H, E, K = 333, 256, 128, 8, 2  # T no multiple of any block
EMPTY = 3
DTYPES = [(torch.bfloat16, 1.5e-2), (torch.float32, 1e-5)]


def problem(dtype, seed):
    """(route map on the GPU, route map for the CPU reference, leaves in float64 on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e != EMPTY])
    ids = allowed[torch.rand(T, len(allowed), generator=g).topk(K, dim=1).indices]
    leaves = [
        torch.randn(T, D, generator=g, dtype=torch.float64),
        torch.rand(T, K, generator=g, dtype=torch.float64),
        torch.randn(E, D, 2 * H, generator=g, dtype=torch.float64) / D**0.5,
        torch.randn(E, H, D, generator=g, dtype=torch.float64) / H**0.5,
    ]
    return build_route_map(ids.cuda(), E, backend="triton"), build_route_map(ids, E, backend="reference"), leaves


def on_gpu(leaves, dtype, float_positions=(1,)):
    """The leaves on the GPU in `dtype`, router weights (position 1) in fp32 as a model keeps them."""
    return [t.to("cuda", torch.float32 if i in float_positions else dtype) for i, t in enumerate(leaves)]


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


def check_grad_and_vjp(fn, ref_fn, leaves_gpu, leaves_ref, tol):
    """torch.func.grad and vjp on the GPU against the float64 reference (within tol) and against eager
    autograd on the same kernels (exactly: the kernels are deterministic, and a warm-up call settles
    their block-shape tuning first)."""
    argnums = tuple(range(len(leaves_gpu)))
    g = torch.Generator().manual_seed(1)
    out = fn(*leaves_gpu)
    cot64 = torch.randn(out.shape, generator=g, dtype=torch.float64)
    cot = cot64.to("cuda", out.dtype)
    want = torch.func.grad(lambda *a: (ref_fn(*a) * cot64).sum(), argnums=argnums)(*leaves_ref)
    xs = [t.clone().requires_grad_() for t in leaves_gpu]
    eager = torch.autograd.grad(fn(*xs), xs, cot)
    got = torch.func.grad(lambda *a: (fn(*a) * cot).sum(), argnums=argnums)(*leaves_gpu)
    out, vjp_fn = torch.func.vjp(fn, *leaves_gpu)
    got_vjp = vjp_fn(cot)
    assert rel(out, ref_fn(*leaves_ref)) < tol
    for a, v, e, w in zip(got, got_vjp, eager, want, strict=True):
        assert torch.equal(a, e) and torch.equal(v, e)
        assert rel(a, w) < tol
    return got


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_torch_func_grad_and_vjp_through_triton_moe_ffn_match_reference_and_eager(dtype, tol):
    rm, rm64, leaves = problem(dtype, 11)
    grads = check_grad_and_vjp(lambda x, w, a, b: moe_ffn(x, rm, w, a, b, "triton"),
                               lambda x, w, a, b: moe_ffn(x, rm64, w, a, b, "reference"),
                               on_gpu(leaves, dtype), leaves, tol)
    assert torch.all(grads[2][EMPTY] == 0) and torch.all(grads[3][EMPTY] == 0)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_torch_func_grad_and_vjp_through_triton_swiglu_experts_and_grouped_gemm(dtype, tol):
    rm, rm64, (x, _, w1, w2) = problem(dtype, 12)
    rows = x[rm64.source_token]
    offsets = rm.offsets
    check_grad_and_vjp(lambda r, a, b: swiglu_experts(r, a, b, offsets, "triton"),
                       lambda r, a, b: swiglu_experts(r, a, b, rm64.offsets, "reference"),
                       on_gpu([rows, w1, w2], dtype, ()), [rows, w1, w2], tol)
    check_grad_and_vjp(lambda r, a: grouped_gemm(r, a, offsets, "triton"),
                       lambda r, a: grouped_gemm(r, a, rm64.offsets, "reference"),
                       on_gpu([rows, w1], dtype, ()), [rows, w1], tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_torch_func_grad_and_vjp_through_triton_permute_and_combine(dtype, tol):
    rm, rm64, (x, weights, _, _) = problem(dtype, 13)
    check_grad_and_vjp(lambda t: permute(t, rm, backend="triton"), lambda t: permute(t, rm64, backend="reference"),
                       on_gpu([x], dtype, ()), [x], tol)
    y = torch.randn(T * K, D, dtype=torch.float64)
    check_grad_and_vjp(lambda r, w: combine(r, rm, w, "triton"), lambda r, w: combine(r, rm64, w, "reference"),
                       on_gpu([y, weights], dtype), [y, weights], tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_torch_func_vmap_and_jacrev_through_triton_match_reference(dtype, tol):
    rm, rm64, leaves = problem(dtype, 14)
    x, weights, w1, w2 = on_gpu(leaves, dtype)

    cot64 = torch.randn(T, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def loss(route_map, backend, x, weights, cot):
        return lambda a, b: (moe_ffn(x, route_map, weights, a, b, backend) * cot).sum()

    scales = ((1, 1), (-1, 0.5))
    per_copy = torch.func.vmap(torch.func.grad(loss(rm, "triton", x, weights, cot64.to("cuda", dtype)), argnums=(0, 1)))(
        torch.stack([w1 * s for s, _ in scales]), torch.stack([w2 * s for _, s in scales]))
    for i, (s1, s2) in enumerate(scales):
        a, b = (w1 * s1).requires_grad_(), (w2 * s2).requires_grad_()
        eager = torch.autograd.grad(loss(rm, "triton", x, weights, cot64.to("cuda", dtype))(a, b), (a, b))
        want = torch.func.grad(loss(rm64, "reference", leaves[0], leaves[1], cot64), argnums=(0, 1))(
            leaves[2] * s1, leaves[3] * s2)
        for j in range(2):  # the vmap rule runs the same kernels per copy: eager's gradients, bit for bit
            assert torch.equal(per_copy[j][i], eager[j]) and rel(per_copy[j][i], want[j]) < tol
    cols = torch.linspace(-1, 1, D, dtype=torch.float64)
    got = torch.func.jacrev(lambda w: moe_ffn(x, rm, w, w1, w2, "triton").double()[5:9] @ cols.cuda())(weights)
    want = torch.func.jacrev(lambda w: moe_ffn(leaves[0], rm64, w, leaves[2], leaves[3], "reference")[5:9] @ cols)(leaves[1])
    assert got.shape == (4, T, K) and rel(got, want) < tol


def test_second_derivatives_and_forward_ad_through_triton_are_refused_by_name():
    rm, _, leaves = problem(torch.bfloat16, 15)
    x, weights, w1, w2 = on_gpu(leaves, torch.bfloat16)

    def loss(w):
        return moe_ffn(x, rm, w, w1, w2, "triton").float().square().sum()

    second = re.escape("SwigluFFNFn: the triton backend's backward is not differentiable")
    with pytest.raises(RuntimeError, match=second):
        torch.func.grad(lambda w: torch.func.grad(loss)(w).square().sum())(weights)
    with pytest.raises(RuntimeError, match="SwigluFFNFn: forward-mode AD .* backend='triton'; use backend='reference' for that transform"):
        torch.func.jvp(loss, (weights,), (weights,))
