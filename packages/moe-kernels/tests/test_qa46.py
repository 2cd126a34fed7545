"""QA 46: moe-kernels used alone by another training stack, on the CPU.

Under torch.autocast every op computes in the dtype it is given, on every backend, as the triton
kernels do: the per-expert loop (reference, or auto where grouped_mm cannot run) returned bf16
rows from fp32 operands, so the second GEMM of a block refused "x (bfloat16) and w (float32)",
and combine's fp32 sum ran as a bf16 bmm. The tests collect alone, with --strict-markers.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_kernels import build_route_map, combine, grouped_gemm, moe_ffn, permute, swiglu_experts


def _block(T=12, d=24, h=12, E=4, k=2, seed=0):
    """d=24 fp32 rows are 96 bytes, h=12 ones 48: grouped_mm takes both, so "torch" runs too."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen, requires_grad=True)
    w1 = (torch.randn(E, d, 2 * h, generator=gen) * d**-0.5).requires_grad_()
    w2 = (torch.randn(E, h, d, generator=gen) * h**-0.5).requires_grad_()
    logits = torch.randn(T, E, generator=gen, requires_grad=True)
    return x, w1, w2, logits, k


def _run(backend, composed, x, w1, w2, logits, k):
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    rm = build_route_map(ids, w1.shape[0])
    if composed:
        return combine(swiglu_experts(permute(x, rm), w1, w2, rm.offsets, backend), rm, weights)
    return moe_ffn(x, rm, weights, w1, w2, backend)


def _grads(out, x, w1, w2, logits):
    """Outside autocast, as torch advises for backward passes."""
    return torch.autograd.grad(out.square().sum(), (x, w1, w2, logits))


@pytest.mark.parametrize("composed", [False, True])
@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_the_block_under_cpu_autocast_computes_in_the_dtype_it_is_given(backend, composed):
    x, w1, w2, logits, k = _block()
    want = _run(backend, composed, x, w1, w2, logits, k)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(backend, composed, x, w1, w2, logits, k)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(_grads(got, x, w1, w2, logits), _grads(want, x, w1, w2, logits)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_grouped_gemm_under_autocast_returns_the_same_dtype_on_every_backend():
    x, w1, _, _, _ = _block()
    offsets = torch.tensor([3, 3, 9, 12], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = {b: grouped_gemm(x, w1, offsets, b) for b in ("auto", "torch", "reference")}
    assert {b: o.dtype for b, o in outs.items()} == dict.fromkeys(outs, torch.float32)
    torch.testing.assert_close(outs["reference"], outs["torch"], rtol=1e-6, atol=1e-6)


def test_combine_under_autocast_keeps_its_fp32_sum():
    gen = torch.Generator().manual_seed(1)
    T, k, d, E = 16, 3, 40, 5
    ids = torch.randint(0, E, (T, k), generator=gen)
    rm = build_route_map(ids, E)
    rows = torch.randn(T * k, d, generator=gen)
    weights = torch.rand(T, k, generator=gen)
    want = combine(rows, rm, weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = combine(rows, rm, weights)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_tests_collect_with_strict_markers_and_no_config_outside_the_package(tmp_path):
    """The gpu / slow marks were registered only in the monorepo's pyproject: alone, every marked
    file warned PytestUnknownMarkWarning, and --strict-markers refused to collect them."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    tests = Path(__file__).parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
         "--strict-markers", "--collect-only", "-q", "-p", "no:cacheprovider", str(tests)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0 and "Unknown pytest.mark" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
