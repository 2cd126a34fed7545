"""Forward-mode AD through the CPU backends: torch's grouped_mm has no forward derivative, so backend="auto"
(which picks grouped_mm on the CPU where it runs) takes the reference GEMMs under jvp, jacfwd, hessian, linearize
and torch.autograd.forward_ad, and gives the reference's tangents; backend="torch" refuses them by name, pointing
to backend="reference" (torch's own error said only that _grouped_mm has no forward AD). fp32, sizes grouped_mm
takes (its 16-byte alignment), odd T, an empty expert."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import hessian, jacfwd, jvp, linearize

from moe_kernels import build_route_map, grouped_gemm, moe_ffn
from moe_kernels.grouped_gemm import torch_grouped_mm_supported

T, E, D, H, K = 7, 4, 8, 4, 2
REFUSAL = r"forward-mode AD .* not supported with backend='torch'.*use backend='reference'"


def _operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    ids = torch.randint(0, E - 1, (T, K), generator=g)  # expert E - 1 gets no rows
    weights = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, D, 2 * H, generator=g) * D**-0.5
    w2 = torch.randn(E, H, D, generator=g) * H**-0.5
    return x, build_route_map(ids, E), weights, w1, w2


def _block(backend: str):
    x, rm, weights, w1, w2 = _operands()
    return (lambda x_, w1_, wt_: moe_ffn(x_, rm, wt_, w1_, w2, backend=backend)), (x, w1, weights)


def test_the_operands_take_grouped_mm_on_the_cpu():
    x, _, _, w1, w2 = _operands()  # else "auto" would take the reference path anyway and the tests prove nothing
    assert torch_grouped_mm_supported(x, w1) and torch_grouped_mm_supported(x, w2, in_cols=H)


def test_auto_gives_the_reference_tangents_under_jvp_and_forward_ad():
    tangents = tuple(torch.randn_like(t) for t in _block("auto")[1])
    results = {}
    for backend in ("auto", "reference"):
        fn, primals = _block(backend)
        out, tangent = jvp(fn, primals, tangents)
        with fwAD.dual_level():
            dual = fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents)))
            dual_tangent = fwAD.unpack_dual(dual).tangent
        _, lin = linearize(fn, *primals)
        results[backend] = (out, tangent, dual_tangent, lin(*tangents))
    for got, want in zip(results["auto"], results["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert results["auto"][1].abs().max() > 0.1  # a real tangent


def test_auto_gives_the_reference_jacfwd_and_hessian():
    got, want = {}, {}
    for backend, out in (("auto", got), ("reference", want)):
        fn, (x, w1, weights) = _block(backend)
        out["jacfwd"] = jacfwd(lambda x_: fn(x_, w1, weights))(x)
        out["hessian"] = hessian(lambda wt_: fn(x, w1, wt_).square().sum())(weights)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_auto_grouped_gemm_under_jvp_equals_the_reference():
    x, rm, _, w1, _ = _operands()
    rows = x[rm.sort_order // K]  # rows in expert order
    tangents = (torch.randn_like(rows), torch.randn_like(w1))
    got = jvp(lambda a, b: grouped_gemm(a, b, rm.offsets, backend="auto"), (rows, w1), tangents)
    want = jvp(lambda a, b: grouped_gemm(a, b, rm.offsets, backend="reference"), (rows, w1), tangents)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian", "linearize", "forward_ad"])
def test_the_torch_backend_refuses_forward_mode_ad_by_name(transform):
    fn, (x, w1, weights) = _block("torch")
    with pytest.raises(RuntimeError, match=REFUSAL):
        if transform == "jvp":
            jvp(fn, (x, w1, weights), (x, w1, weights))
        elif transform == "jacfwd":
            jacfwd(lambda x_: fn(x_, w1, weights))(x)
        elif transform == "hessian":
            hessian(lambda wt_: fn(x, w1, wt_).sum())(weights)
        elif transform == "linearize":
            linearize(fn, x, w1, weights)
        else:
            with fwAD.dual_level():
                fn(fwAD.make_dual(x, torch.ones_like(x)), w1, weights)


def test_the_torch_backend_still_runs_reverse_mode():
    fn, primals = _block("torch")
    primals = tuple(p.requires_grad_() for p in primals)
    grads = torch.autograd.grad(fn(*primals).square().sum(), primals)
    ref_fn, ref_primals = _block("reference")
    ref_primals = tuple(p.requires_grad_() for p in ref_primals)
    want = torch.autograd.grad(ref_fn(*ref_primals).square().sum(), ref_primals)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
