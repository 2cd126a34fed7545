"""The cooperative Gluon weight gradient (moe_kernels.triton.gluon_wgrad) on a Hopper GPU against
an fp64 reference: odd expert sizes, empty experts, E=256, tiles past the grid, N off the tile
width, both 16-bit dtypes, and rows of other experts that hold NaN.

Run on the device: PYTHONPATH=packages/moe-kernels/src python3 -m pytest -m gpu packages/moe-kernels/tests/test_gluon_wgrad_gpu.py
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _hopper_with_gluon():
    from moe_kernels.triton.gluon_wgrad import gluon_wgrad_available

    return gluon_wgrad_available() and torch.cuda.get_device_capability() == (9, 0)


needs_gluon = pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                                 reason="needs an sm_90 GPU and a triton the Gluon kernel was checked on")


def _problem(E, K, N, counts, dtype, seed, extra_rows=0):
    g = torch.Generator().manual_seed(seed)
    rows = int(counts.sum()) + extra_rows
    a = torch.randn(rows, K, generator=g).to("cuda", dtype)
    b = torch.randn(rows, N, generator=g).to("cuda", dtype)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    return a, b, offs


def _reference(a, b, counts):
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0] + ends[:-1]
    return torch.stack([a.double()[s:t].T @ b.double()[s:t] for s, t in zip(starts, ends)])


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


CASES = [  # E, K, N, counts
    (12, 256, 200, "odd"),  # N off the tile width, experts of 0..129 rows
    (256, 128, 136, "sparse"),  # E=256, most experts empty or one row
    (128, 512, 1024, "random"),  # (b)-like per-expert sizes: 4096 tiles, many per program and consumer
    (1, 128, 64, "one"),  # fewer tiles than SMs: one consumer of each program idle
]


def _counts(kind, E, g):
    if kind == "odd":
        c = torch.randint(1, 130, (E,), generator=g)
        c[[2, 7]] = 0
    elif kind == "sparse":
        c = torch.randint(0, 3, (E,), generator=g) * (torch.rand(E, generator=g) < 0.3)
        c[5] = 77
    elif kind == "random":
        c = torch.bincount(torch.randn(16384, E, generator=g).topk(4, dim=1).indices.reshape(-1), minlength=E)
    else:
        c = torch.tensor([333])
    return c


@needs_gluon
@pytest.mark.parametrize("chunk_rows,stages", [(32, 6), (64, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,K,N,kind", CASES)
def test_gluon_wgrad_matches_reference(E, K, N, kind, dtype, chunk_rows, stages):
    from moe_kernels.triton.gluon_wgrad import gluon_wgrad_launch, gluon_wgrad_supports

    g = torch.Generator().manual_seed(E + K + N)
    counts = _counts(kind, E, g)
    a, b, offs = _problem(E, K, N, counts, dtype, seed=E * 7 + N)
    assert gluon_wgrad_supports(a, b, dtype, None)  # the test must run the Gluon kernel, not a fallback
    out = torch.full((E, K, N), float("nan"), dtype=dtype, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gluon_wgrad_launch(a, b, offs, out, sms, chunk_rows=chunk_rows, stages=stages)
    torch.cuda.synchronize()
    ref = _reference(a, b, counts)
    assert _rel(out, ref) < 1e-2
    empty = (counts == 0).nonzero().flatten().tolist()
    assert torch.all(out[empty] == 0)


@needs_gluon
@pytest.mark.parametrize("chunk_rows,stages", [(32, 6), (64, 3), (64, 2), (16, 12), (16, 4), (32, 2)])
def test_gluon_wgrad_keeps_other_experts_rows_out(chunk_rows, stages):
    """Expert 3's rows and the rows past the last expert are NaN: every other expert's gradient
    (expert 2's last chunk reads expert 3's rows, the last expert's reads the trailing ones) is
    exact, so the zeroing of an expert's tail rows covers both operands."""
    from moe_kernels.triton.gluon_wgrad import gluon_wgrad_launch

    E, K, N = 6, 256, 264
    counts = torch.tensor([70, 1, 100, 50, 0, 129])
    a, b, offs = _problem(E, K, N, counts, torch.bfloat16, seed=5, extra_rows=40)
    ends = torch.cumsum(counts, 0).tolist()
    a[ends[2]:ends[3]] = float("nan")
    b[ends[2]:ends[3]] = float("nan")
    a[ends[-1]:] = float("nan")
    b[ends[-1]:] = float("nan")
    out = torch.empty(E, K, N, dtype=torch.bfloat16, device="cuda")
    gluon_wgrad_launch(a, b, offs, out, torch.cuda.get_device_properties(0).multi_processor_count,
                       chunk_rows=chunk_rows, stages=stages)
    ref = _reference(a.nan_to_num(0.0), b.nan_to_num(0.0), counts)
    for e in (0, 1, 2, 4, 5):
        assert torch.isfinite(out[e]).all(), e
        assert _rel(out[e], ref[e]) < 1e-2 or (counts[e] == 0 and torch.all(out[e] == 0)), e


@needs_gluon
def test_tuned_wgrad_offers_gluon_and_falls_back_on_unaligned_operands():
    """grouped_wgrad_launch's forced Gluon config runs the Gluon kernel where it can and the
    default Triton kernel where it cannot (K off the tile height, a gathered A), with equal results."""
    from moe_kernels.triton.grouped_gemm_kernels import _GLUON_WGRAD, grouped_wgrad_launch

    g = torch.Generator().manual_seed(2)
    E, N = 8, 192
    counts = torch.randint(0, 90, (E,), generator=g)
    for K, cfg in ((256, _GLUON_WGRAD[0]), (384, _GLUON_WGRAD[1]), (200, _GLUON_WGRAD[0])):
        a, b, offs = _problem(E, K, N, counts, torch.bfloat16, seed=K)
        out = grouped_wgrad_launch(a, b, offs, E, config=cfg)
        assert _rel(out, _reference(a, b, counts)) < 1e-2
    T, k = int(counts.sum()), 1
    a, b, offs = _problem(E, 256, N, counts, torch.bfloat16, seed=9)
    gather = torch.randperm(T, generator=g).to("cuda", torch.int32)
    out = grouped_wgrad_launch(a, b, offs, E, gather=gather, top_k=k, config=_GLUON_WGRAD[0])
    assert _rel(out, _reference(a[gather.long()], b, counts)) < 1e-2


@needs_gluon
def test_gluon_wgrad_takes_int64_offsets():
    """grouped_wgrad_launch is public below the int32 conversion of the functional API: int64
    offsets (a hand-built route map's) give the int32 result instead of a compile error."""
    from moe_kernels.triton.gluon_wgrad import gluon_wgrad_launch

    E, K, N = 5, 256, 320
    counts = torch.tensor([90, 0, 33, 128, 7])
    a, b, offs = _problem(E, K, N, counts, torch.bfloat16, seed=11)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out32 = torch.empty(E, K, N, dtype=torch.bfloat16, device="cuda")
    out64 = torch.empty_like(out32)
    gluon_wgrad_launch(a, b, offs, out32, sms)
    gluon_wgrad_launch(a, b, offs.long(), out64, sms)
    assert torch.equal(out32, out64)
    assert _rel(out64, _reference(a, b, counts)) < 1e-2
