"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

PrecisionRecipe.expert_ffn / fused_moe_ffn given fp32 rows (e.g. a codec's decode) under bf16 autocast: autocast
casts no grouped GEMM input, so the recipe must cast the rows to the GEMM dtype itself (gemm_input). Nothing tested
it: with gemm_input returning x unchanged every test passed, and this call raised a dtype-mismatch ValueError."""

import torch

from moe_kernels import build_route_map
from moe_precision.recipe import PrecisionRecipe


def _problem():
    g = torch.Generator().manual_seed(0)
    E, d, h, T, k = 3, 8, 4, 6, 2
    x = torch.randn(T, d, generator=g)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    weights = torch.rand(T, k, generator=g)
    w1 = torch.randn(E, d, 2 * h, generator=g)
    w2 = torch.randn(E, h, d, generator=g)
    return x, ids, weights, w1, w2, E


def test_expert_ffn_casts_fp32_rows_to_the_autocast_dtype():
    x, ids, _, w1, w2, E = _problem()
    rm = build_route_map(ids, E, backend="reference")
    rows = x[rm.sort_order // ids.shape[1]]  # rows in expert order
    r = PrecisionRecipe()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = r.expert_ffn(rows, w1, w2, rm.offsets, backend="reference")
    ref = r.expert_ffn(rows.bfloat16(), w1.bfloat16(), w2.bfloat16(), rm.offsets, backend="reference")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_fused_moe_ffn_casts_fp32_tokens_to_the_autocast_dtype():
    x, ids, weights, w1, w2, E = _problem()
    rm = build_route_map(ids, E, backend="reference")
    r = PrecisionRecipe()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = r.fused_moe_ffn(x, rm, weights.bfloat16(), w1, w2, backend="reference")
    ref = r.fused_moe_ffn(x.bfloat16(), rm, weights.bfloat16(), w1.bfloat16(), w2.bfloat16(), backend="reference")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
