"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

combine_backward (triton) with d_model wider than its 256-column block: the router-weight gradient must sum
<g[t], y[dest]> over every column chunk, not only the last one (every tested d was <= 256, so D_CHUNKS was 1)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")

CODE = r"""
import torch
from moe_kernels.triton.permute_kernels import combine_backward
g = torch.Generator().manual_seed(0)
for T, k, d in [(5, 2, 300), (3, 3, 513), (4, 1, 257)]:
    R = T * k
    dest = torch.randperm(R, generator=g)
    y = torch.randn(R, d, generator=g)
    w = torch.rand(T, k, generator=g)
    grad = torch.randn(T, d, generator=g)
    dy, gw = combine_backward(grad, y, dest, w)
    d_rows = dest.view(T, k)
    ref_gw = torch.einsum("td,tkd->tk", grad.double(), y[d_rows].double()).float()
    ref_dy = torch.empty_like(y)
    ref_dy[d_rows.reshape(-1)] = (w[:, :, None] * grad[:, None, :]).reshape(R, d)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dy, ref_dy)
print("OK")
"""


def test_combine_backward_router_grad_covers_every_column_chunk():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
