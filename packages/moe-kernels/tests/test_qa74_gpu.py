"""QA 74's refusals on a CUDA GPU, with the compiled kernels (test_qa74.py runs them under Triton's CPU
interpreter, and simulates the GPU for backend="torch"): forward-mode AD (eager dual tensors, linearize, a
Hessian-vector product) and the legacy batched backward (is_grads_batched, jacobian(vectorize=True)) are
refused by name, naming backend='reference', before any kernel runs; backend="torch" on a GPU (which runs the
fused block on grouped_mm) refuses forward AD the same way; what the messages point to runs.

Run on the device: PYTHONPATH=packages/moe-kernels/src python3 -m pytest -m gpu packages/moe-kernels/tests/test_qa74_gpu.py
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from moe_kernels import build_route_map, combine, grouped_gemm, moe_ffn, permute

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

T, D, H, E, K = 77, 64, 32, 5, 2
FORWARD_AD = r"forward-mode AD .* not supported with backend='triton'; use backend='reference' for that transform"
LEGACY_VMAP = r"backend='triton' cannot run its backward under torch.autograd.grad\(\.\.\., is_grads_batched=True\)"


def _problem(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
    rm = build_route_map(ids, E, backend="triton")
    x = torch.randn(T, D, generator=g).to("cuda", dtype)
    w = torch.rand(T, K, generator=g).cuda()
    w1 = (torch.randn(E, D, 2 * H, generator=g) / D**0.5).to("cuda", dtype)
    w2 = (torch.randn(E, H, D, generator=g) / H**0.5).to("cuda", dtype)
    return rm, x, w, w1, w2


def test_forward_ad_refused_by_name_on_every_function():
    rm, x, w, w1, w2 = _problem(1)
    rows = x[rm.source_token]
    calls = {
        "SwigluFFNFn": lambda d: moe_ffn(x, rm, d, w1, w2, "triton"),
        "CombineFn": lambda d: combine(rows, rm, d, "triton"),
        "PermuteFn": lambda d: permute(x * d[:, :1], rm, backend="triton"),
        "GroupedGemmFn": lambda d: grouped_gemm(rows * d.sum(), w1, rm.offsets, "triton"),
    }
    for name, call in calls.items():
        with fwAD.dual_level(), pytest.raises(RuntimeError, match=f"{name}: {FORWARD_AD}"):
            call(fwAD.make_dual(w, torch.ones_like(w)))
    with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {FORWARD_AD}"):
        torch.func.linearize(calls["SwigluFFNFn"], w)
    loss = lambda d: moe_ffn(x, rm, d, w1, w2, "triton").square().sum()  # noqa: E731
    with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {FORWARD_AD}"):
        torch.func.jvp(torch.func.grad(loss), (w,), (torch.ones_like(w),))
    # an open dual level with plain inputs is no forward AD: the kernels run and match the reference
    with fwAD.dual_level():
        got = moe_ffn(x, rm, w, w1, w2, "triton")
    torch.testing.assert_close(got, moe_ffn(x, rm, w, w1, w2, "reference"), rtol=1e-4, atol=1e-4)


def test_legacy_batched_backward_refused_by_name():
    rm, x, w, w1, w2 = _problem(2)
    cots = torch.randn(3, T, D, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
    out = moe_ffn(leaves[0], rm, leaves[1], leaves[2], leaves[3], "triton")
    with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {LEGACY_VMAP}"):
        torch.autograd.grad(out, leaves, cots, is_grads_batched=True)
    rows = x[rm.source_token]
    with pytest.raises(RuntimeError, match=f"CombineFn: {LEGACY_VMAP}"):
        torch.autograd.functional.jacobian(lambda d: combine(rows, rm, d, "triton")[:2], w, vectorize=True)
    # what the message points to: the reference backend, and torch.func.jacrev on the triton one
    ref = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
    torch.autograd.grad(moe_ffn(ref[0], rm, ref[1], ref[2], ref[3], "reference"), ref, cots, is_grads_batched=True)
    got = torch.func.jacrev(lambda d: moe_ffn(x, rm, d, w1, w2, "triton")[:2, :3])(w)
    want = torch.func.jacrev(lambda d: moe_ffn(x, rm, d, w1, w2, "reference")[:2, :3])(w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_torch_backend_refuses_forward_ad_naming_reference():
    rm, x, w, w1, w2 = _problem(3, torch.bfloat16)  # backend="torch" takes bf16 on a GPU (grouped_mm)
    gpu_note = r" \(on a GPU, backend='torch' and 'auto'"
    with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {FORWARD_AD}{gpu_note}"):
        torch.func.jvp(lambda d: moe_ffn(x, rm, d, w1, w2, "torch"), (w,), (torch.ones_like(w),))
    out, tangent = torch.func.jvp(lambda d: moe_ffn(x, rm, d, w1, w2, "reference"), (w,), (torch.ones_like(w),))
    assert out.shape == tangent.shape == (T, D) and torch.isfinite(tangent.float()).all()
