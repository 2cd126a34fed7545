"""torch.func (grad, vjp, vmap, jacrev) through the triton backend, under Triton's CPU interpreter.

The triton autograd Functions (the fused block, grouped GEMM, permute, combine) take torch.func's
transforms: grad and vjp give the reference backend's gradients and eager `.backward()`'s, vmap and
jacrev run the kernels sample by sample. What the kernels cannot give is refused by name: a
second derivative (nested grad) and forward-mode AD (jvp, jacfwd, hessian).

TRITON_INTERPRET must be set before any @triton.jit function is defined, so the checks run in a
subprocess (this file run as a script), each reported to its own test. Small odd shapes (T=13,
no multiple of a block), an empty expert; fp32 against the reference, and bf16 against eager
autograd on the same kernels (the interpreter truncates fp32->bf16 stores, so bf16 matches the
reference only loosely).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import interpreter_checks  # noqa: E402

try:
    import numpy  # noqa: F401  (Triton's interpreter runs on numpy)
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

T, D, H, E, K = 13, 24, 16, 4, 2
EMPTY = 2  # no token routes to this expert


def _problem(torch, moe, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e != EMPTY])
    ids = allowed[torch.rand(T, len(allowed), generator=g).topk(K, dim=1).indices]
    rm = moe.build_route_map(ids, E, backend="reference")
    leaves = [
        torch.randn(T, D, generator=g),
        torch.rand(T, K, generator=g),
        torch.randn(E, D, 2 * H, generator=g) / D**0.5,
        torch.randn(E, H, D, generator=g) / H**0.5,
    ]
    return rm, [t.to(dtype) for t in leaves[:1]] + [leaves[1]] + [t.to(dtype) for t in leaves[2:]]


def _eager_grads(torch, fn, leaves, cotangent):
    xs = [t.clone().requires_grad_() for t in leaves]
    out = fn(*xs)
    return out.detach(), torch.autograd.grad(out, xs, cotangent)


def _close(torch, got, want, tol=1e-4):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _check_grad_and_vjp(torch, fn_of_backend, leaves):
    """torch.func.grad and vjp through backend="triton" against the reference backend and against
    eager autograd on the triton kernels."""
    fn, ref = fn_of_backend("triton"), fn_of_backend("reference")
    argnums = tuple(range(len(leaves)))
    g = torch.Generator().manual_seed(len(leaves))
    cot = torch.randn(fn(*leaves).shape, generator=g)

    def loss(f):
        return lambda *a: (f(*a) * cot).sum()

    got = torch.func.grad(loss(fn), argnums=argnums)(*leaves)
    want = torch.func.grad(loss(ref), argnums=argnums)(*leaves)
    eager_out, eager = _eager_grads(torch, fn, leaves, cot)
    _close(torch, got, want)
    _close(torch, got, eager, tol=0)
    out, vjp_fn = torch.func.vjp(fn, *leaves)
    _close(torch, [out], [eager_out], tol=0)
    got_vjp = vjp_fn(cot)
    _close(torch, got_vjp, want)
    _close(torch, got_vjp, eager, tol=0)
    return got


def check_grad_and_vjp_through_moe_ffn(torch, moe):
    rm, leaves = _problem(torch, moe, 1, torch.float32)
    grads = _check_grad_and_vjp(torch, lambda b: lambda x, w, w1, w2: moe.moe_ffn(x, rm, w, w1, w2, b), leaves)
    assert all(torch.count_nonzero(gw[EMPTY]) == 0 for gw in grads[2:])


def check_grad_and_vjp_through_swiglu_experts(torch, moe):
    rm, (x, _, w1, w2) = _problem(torch, moe, 2, torch.float32)
    rows = x[rm.source_token]
    _check_grad_and_vjp(torch, lambda b: lambda r, w1, w2: moe.swiglu_experts(r, w1, w2, rm.offsets, b), [rows, w1, w2])


def check_grad_and_vjp_through_grouped_gemm(torch, moe):
    rm, (x, _, w1, _) = _problem(torch, moe, 3, torch.float32)
    # a strided x: the grouped GEMM reads a contiguous copy made inside the graph
    strided = x[rm.source_token].T.contiguous().T
    _check_grad_and_vjp(torch, lambda b: lambda r, w: moe.grouped_gemm(r, w, rm.offsets, b), [strided, w1])


def check_grad_and_vjp_through_permute_and_combine(torch, moe):
    rm, (x, weights, _, _) = _problem(torch, moe, 4, torch.float32)
    _check_grad_and_vjp(torch, lambda b: lambda t: moe.permute(t, rm, backend=b), [x])
    y = torch.randn(rm.num_rows, D)
    _check_grad_and_vjp(torch, lambda b: lambda r, w: moe.combine(r, rm, w, b), [y, weights])


def check_vmap_runs_the_kernels_per_sample(torch, moe):
    """vmap of the forward (with eager autograd below it), and vmap of grad (per-copy gradients)."""
    rm, (x, weights, w1, w2) = _problem(torch, moe, 5, torch.float32)
    xb = torch.randn(2, T, D).requires_grad_()
    out = torch.func.vmap(lambda t: moe.moe_ffn(t, rm, weights, w1, w2, "triton"))(xb)
    out.square().sum().backward()
    xr = xb.detach().clone().requires_grad_()
    want = torch.stack([moe.moe_ffn(t, rm, weights, w1, w2, "reference") for t in xr])
    want.square().sum().backward()
    _close(torch, [out, xb.grad], [want, xr.grad])

    def loss(backend):
        return lambda a, b: moe.moe_ffn(x, rm, weights, a, b, backend).square().sum()

    w1s, w2s = torch.stack([w1, -w1]), torch.stack([w2, 0.5 * w2])
    per_copy = {b: torch.func.vmap(torch.func.grad(loss(b), argnums=(0, 1)))(w1s, w2s) for b in ("triton", "reference")}
    _close(torch, per_copy["triton"], per_copy["reference"])
    # the weights batched on a dim other than 0, through the grouped GEMM
    rows = x[rm.source_token]
    ws = torch.stack([w1, 3 * w1], dim=1)
    got = torch.func.vmap(lambda w: moe.grouped_gemm(rows, w, rm.offsets, "triton"), in_dims=1)(ws)
    _close(torch, got, torch.stack([moe.grouped_gemm(rows, ws[:, i], rm.offsets, "reference") for i in range(2)]))
    # permute and combine over a batch of rows
    got = torch.func.vmap(lambda t: moe.permute(t, rm, backend="triton"))(xb.detach())
    _close(torch, got, torch.stack([moe.permute(t, rm, backend="reference") for t in xb.detach()]))
    yb = torch.randn(2, rm.num_rows, D)
    got = torch.func.vmap(lambda r: moe.combine(r, rm, weights, "triton"))(yb)
    _close(torch, got, torch.stack([moe.combine(r, rm, weights, "reference") for r in yb]))


def check_jacrev_matches_reference(torch, moe):
    """jacrev = vmap of the vjp over basis cotangents: the backward itself runs under vmap."""
    rm, (x, weights, w1, w2) = _problem(torch, moe, 6, torch.float32)
    cols = torch.linspace(-1, 1, D)

    def block(backend):  # 4 outputs: jacrev runs the backward on a batch of 4 basis cotangents
        return lambda w, a: (moe.moe_ffn(x, rm, w, a, w2, backend) @ cols)[3:7]

    got = torch.func.jacrev(block("triton"), argnums=(0, 1))(weights, w1)
    _close(torch, got, torch.func.jacrev(block("reference"), argnums=(0, 1))(weights, w1))
    rows, offsets = x[:5], torch.tensor([2, 5, 5, 5], dtype=torch.int32)  # experts 2 and 3 empty

    def gemm(backend):
        return lambda w: moe.grouped_gemm(rows, w, offsets, backend)[:2, :2]

    got = torch.func.jacrev(gemm("triton"))(w1)
    assert got.shape == (2, 2, E, D, 2 * H)
    want = torch.func.jacrev(gemm("reference"))(w1)
    _close(torch, [got], [want])
    got = torch.func.jacrev(lambda w: moe.combine(moe.permute(x, rm, backend="triton"), rm, w, "triton")[:4] @ cols)(weights)
    want = torch.func.jacrev(lambda w: moe.combine(moe.permute(x, rm, backend="reference"), rm, w, "reference")[:4] @ cols)(weights)
    _close(torch, [got], [want])


def check_bf16_grad_and_vjp_equal_eager(torch, moe):
    """bf16: torch.func gives exactly eager autograd's gradients on the same kernels; the reference
    (fp32 data) only loosely, as the interpreter truncates bf16 stores."""
    rm, leaves = _problem(torch, moe, 7, torch.bfloat16)

    def fn(x, w, w1, w2):
        return moe.moe_ffn(x, rm, w, w1, w2, "triton")

    cot = torch.randn(T, D).bfloat16()
    got = torch.func.grad(lambda *a: (fn(*a).float() * cot.float()).sum(), argnums=(0, 1, 2, 3))(*leaves)
    _, eager = _eager_grads(torch, lambda *a: fn(*a).float(), leaves, cot.float())
    _close(torch, got, eager, tol=0)
    _, vjp_fn = torch.func.vjp(fn, *leaves)
    _close(torch, vjp_fn(cot), eager, tol=0)  # .float()'s backward hands the kernels cot itself
    fp32 = [t.float() for t in leaves]
    want = torch.func.grad(lambda *a: (moe.moe_ffn(a[0], rm, a[1], a[2], a[3], "reference") * cot.float()).sum(),
                           argnums=(0, 1, 2, 3))(*fp32)
    for a, b in zip(got, want):
        assert ((a.float() - b).norm() / b.norm()).item() < 3e-2


def check_second_derivatives_and_forward_ad_are_refused_by_name(torch, moe):
    """Nested grad differentiates the kernels' backward: refused in refuse_double_backward's words,
    as create_graph=True is in eager autograd; jvp / jacfwd / hessian (forward-mode AD) name
    backend='triton' and the backends that take them."""
    import re

    rm, (x, weights, w1, w2) = _problem(torch, moe, 8, torch.float32)
    rows = x[rm.source_token]
    second = "the triton backend's backward is not differentiable"
    forward_ad = r"forward-mode AD .* not supported with backend='triton'; use backend='reference' for that transform"
    calls = {
        "SwigluFFNFn": lambda w: moe.moe_ffn(x, rm, w, w1, w2, "triton").square().sum(),
        "GroupedGemmFn": lambda w: moe.grouped_gemm(rows * w[0, 0], w1, rm.offsets, "triton").square().sum(),
        "PermuteFn": lambda w: moe.permute(x * w[0, 0], rm, backend="triton").square().sum(),
        "CombineFn": lambda w: moe.combine(rows, rm, w, "triton").square().sum(),
    }
    for name, loss in calls.items():
        with pytest.raises(RuntimeError, match=f"{name}: {re.escape(second)}"):
            torch.func.grad(lambda w: torch.func.grad(loss)(w).square().sum())(weights)
    wg = weights.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {re.escape(second)}"):  # eager, as before
        torch.autograd.grad(calls["SwigluFFNFn"](wg), wg, create_graph=True)
    with pytest.raises(RuntimeError, match="CombineFn: " + forward_ad):
        torch.func.hessian(calls["CombineFn"])(weights)  # jacfwd of jacrev: forward-mode AD meets the forward first
    with pytest.raises(RuntimeError, match="SwigluFFNFn: " + forward_ad):
        torch.func.jvp(lambda w: moe.moe_ffn(x, rm, w, w1, w2, "triton"), (weights,), (weights,))
    with pytest.raises(RuntimeError, match="GroupedGemmFn: " + forward_ad):
        torch.func.jacfwd(lambda w: moe.grouped_gemm(rows, w, rm.offsets, "triton"))(w1)


CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


@pytest.mark.skipif(not HAVE_TRITON, reason="triton or numpy (its interpreter needs it) is not installed")
@pytest.mark.parametrize("check", list(CHECKS))
def test_torch_func_through_triton_backend_under_interpreter(interpreter_verdicts, check):
    assert interpreter_verdicts[check]["verdict"] == "ok", interpreter_verdicts[check]["verdict"]


if __name__ == "__main__":
    import torch

    import moe_kernels as moe

    interpreter_checks.run_checks(CHECKS, torch, moe)

