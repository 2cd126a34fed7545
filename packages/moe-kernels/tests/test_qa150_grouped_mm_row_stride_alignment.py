"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

torch_grouped_mm_supported must refuse a weight view whose row stride is not a 16-byte multiple even when its
width is (w = big[..., :4] of a [E, K, 6] fp32 tensor: rows 16 bytes wide, 24 bytes apart); torch's grouped_mm raises
"strides should be multiple of 16 bytes" on it. Checking 8-byte alignment instead passed every test, and backend=
"auto" then crashed where it falls back to the per-expert loop."""

import pytest
import torch

from moe_kernels import grouped_gemm
from moe_kernels.grouped_gemm import torch_grouped_mm_supported


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_a_weight_view_with_24_byte_rows_apart_is_not_sent_to_grouped_mm():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3, 8, 6, generator=g)
    w = big[..., :4]  # stride (48, 6, 1): 24 bytes between rows
    x = torch.randn(10, 8, generator=g)
    offsets = torch.tensor([3, 7, 10], dtype=torch.int32)
    assert not torch_grouped_mm_supported(x, w)
    out = grouped_gemm(x, w, offsets, backend="auto")
    torch.testing.assert_close(out, grouped_gemm(x, w.contiguous(), offsets, backend="reference"))
