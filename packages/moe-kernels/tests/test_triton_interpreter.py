"""The triton kernels under Triton's CPU interpreter, compared with the reference.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so the checks run
in a subprocess (this file run as a script). fp32 only: the interpreter mishandles bf16
arithmetic and truncates fp32->bf16 stores (bf16 parity runs on the GPU, test_triton_gpu.py).
"""

import os
import subprocess
import sys

import pytest

try:
    import numpy  # noqa: F401  (Triton's interpreter runs on numpy; `pip install moe-kernels[test]` brings it)
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False


def _check_route_map(torch, moe):
    for T, k, E, empty in [(37, 3, 5, (1, 3)), (300, 4, 256, ()), (1, 1, 1, ())]:
        g = torch.Generator().manual_seed(T)
        allowed = torch.tensor([e for e in range(E) if e not in empty])
        ids = allowed[torch.rand(T, len(allowed), generator=g).topk(k, dim=1).indices]
        ref = moe.build_route_map(ids, E, backend="reference")
        out = moe.build_route_map(ids, E, backend="triton")
        for name in ("counts", "offsets", "sort_order", "dest_row"):
            a, b = getattr(out, name), getattr(ref, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, T, k, E)


def _check_block(torch, moe):
    # odd T, empty experts, E not a power of two, d and h not multiples of any block
    # (E=256 runs here for the route map and on the GPU for the block: the interpreter is slow per tile)
    for T, d, h, E, k, empty in [(37, 40, 24, 6, 2, (0, 4)), (23, 16, 8, 12, 3, (5,))]:
        g = torch.Generator().manual_seed(T * E)
        allowed = torch.tensor([e for e in range(E) if e not in empty])
        ids = allowed[torch.rand(T, len(allowed), generator=g).topk(k, dim=1).indices]
        leaves = [
            torch.randn(T, d, generator=g),
            torch.rand(T, k, generator=g),
            torch.randn(E, d, 2 * h, generator=g) / d**0.5,
            torch.randn(E, h, d, generator=g) / h**0.5,
        ]
        rm = moe.build_route_map(ids, E, backend="triton")
        results = {}
        for backend in ("reference", "triton"):
            xs = [t.clone().requires_grad_() for t in leaves]
            out = moe.moe_ffn(xs[0], rm, xs[1], xs[2], xs[3], backend=backend)
            out.backward(torch.ones_like(out) + torch.arange(d) / d)
            results[backend] = [out] + [t.grad for t in xs]
        for a, b in zip(results["triton"], results["reference"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for e in empty:
            assert torch.all(results["triton"][3][e] == 0) and torch.all(results["triton"][4][e] == 0)
        if E != 6:
            continue
        # the unfused triton ops: permute, grouped GEMM (fwd, dgrad, wgrad), combine
        xs = [t.clone().requires_grad_() for t in leaves]
        rows = moe.permute(xs[0], rm, backend="triton")
        hmid = moe.grouped_gemm(rows, xs[2], rm.offsets, backend="triton")
        y = moe.grouped_gemm(hmid[:, :h].contiguous(), xs[3], rm.offsets, backend="triton")
        out = moe.combine(y, rm, xs[1], backend="triton")
        out.sum().backward()
        ref_leaves = [t.clone().requires_grad_() for t in leaves]
        rows = moe.permute(ref_leaves[0], rm, backend="reference")
        hmid = moe.grouped_gemm(rows, ref_leaves[2], rm.offsets, backend="reference")
        y = moe.grouped_gemm(hmid[:, :h].contiguous(), ref_leaves[3], rm.offsets, backend="reference")
        ref = moe.combine(y, rm, ref_leaves[1], backend="reference")
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        for a, b in zip(xs, ref_leaves):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton or numpy (its interpreter needs it) is not installed")
def test_triton_kernels_match_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    import moe_kernels as moe

    torch.set_num_threads(2)
    _check_route_map(torch, moe)
    _check_block(torch, moe)
    print("ok")
