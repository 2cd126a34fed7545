"""QA 152's checks on a CUDA GPU, with the compiled kernels (test_qa152_review.py runs them on the CPU, where `auto`
means grouped_mm or the reference loop; on a GPU `auto` means the Triton kernels, whose tensor descriptors see the
weight's strides, and the block's plan search):
1. an expand()ed expert weight (a stride of 0) gives the reference numbers, forward and every gradient, on `auto` and
   `triton`, alone and as either weight of the block, and backend="torch" refuses it by name before any GEMM runs;
2. grouped_gemm refuses integer, complex and fp8 operands on the GPU as on the CPU, naming the dtype.

Run on the device: PYTHONPATH=packages/moe-kernels/src python3 -m pytest -m gpu \
    packages/moe-kernels/tests/test_qa152_gpu.py
"""

import pytest
import torch

from moe_kernels import build_route_map, grouped_gemm, grouped_gemm_reference, moe_ffn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, K, M = 5, 64, 48
COUNTS = [37, 0, 64, 1, 29]  # an empty expert, a one-row expert, no count a multiple of a block size
LAYOUTS = ["stride 0 in M", "stride 0 in K", "column-major stride 0"]


def _expanded(layout: str, e: int, k: int, m: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """An expand()ed weight made on the GPU (moving an expanded CPU tensor to CUDA would materialise it)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "stride 0 in M":
        return torch.randn(e, k, 1, generator=g).to("cuda", dtype).expand(e, k, m)
    if layout == "stride 0 in K":
        return torch.randn(e, 1, m, generator=g).to("cuda", dtype).expand(e, k, m)
    return torch.randn(e, m, 1, generator=g).to("cuda", dtype).expand(e, m, k).transpose(1, 2)


def _tolerance(dtype):
    return {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_an_expanded_weight_gives_the_reference_forward_and_gradients(backend, layout, dtype):
    w = _expanded(layout, E, K, M, dtype, seed=152)
    assert 0 in w.stride(), w.stride()
    offsets = torch.tensor(COUNTS, device="cuda").cumsum(0).to(torch.int32)
    n = sum(COUNTS)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, K, generator=g).to("cuda", dtype).requires_grad_()
    gy = torch.randn(n, M, generator=g).to("cuda", dtype)
    w_got = w.detach().requires_grad_()
    got = grouped_gemm(x, w_got, offsets, backend=backend)
    gx, gw = torch.autograd.grad(got, (x, w_got), gy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().contiguous().double().requires_grad_()
    want = grouped_gemm_reference(x64, w64, offsets)
    wgx, wgw = torch.autograd.grad(want, (x64, w64), gy.double())
    torch.testing.assert_close(got.double(), want, **_tolerance(dtype))
    torch.testing.assert_close(gx.double(), wgx, **_tolerance(dtype))
    torch.testing.assert_close(gw.double(), wgw, **_tolerance(dtype))
    assert gw.shape == w.shape


@pytest.mark.parametrize("expanded", ["w_gate_up", "w_down"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_block_with_an_expanded_weight_gives_the_reference(backend, expanded):
    T, d, h, k, e = 203, 64, 32, 2, 6
    g = torch.Generator().manual_seed(7)
    ids = torch.rand(T, e, generator=g).topk(k, dim=1).indices
    ids[ids == 3] = 4  # expert 3 empty
    rm = build_route_map(ids.cuda(), e)
    x = torch.randn(T, d, generator=g).to("cuda", torch.bfloat16)
    router = torch.rand(T, k, generator=g).cuda()
    w1 = (torch.randn(e, d, 2 * h, generator=g) / d**0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(e, h, d, generator=g) / h**0.5).to("cuda", torch.bfloat16)
    if expanded == "w_gate_up":
        w1 = w1[:, :1, :].expand(e, d, 2 * h)
    else:
        w2 = w2[:, :, :1].expand(e, h, d)
    leaves = [t.detach().requires_grad_() for t in (x, router, w1, w2)]
    got = moe_ffn(leaves[0], rm, leaves[1], leaves[2], leaves[3], backend=backend)
    gy = torch.randn(T, d, generator=g).to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(got, leaves, gy)
    ref = [t.detach().contiguous().double().requires_grad_() for t in (x, router, w1, w2)]
    want = moe_ffn(ref[0], rm, ref[1], ref[2], ref[3], backend="reference")
    want_grads = torch.autograd.grad(want, ref, gy.double())
    # norm-wise relative error against float64 truth, bf16's bound of test_qa98 (4u, u = 2^-8): an elementwise
    # bound fails on a router-weight gradient, a 64-term dot product of bf16-rounded expert outputs, on any backend
    errors = {name: ((a.double() - b).norm() / b.norm()).item()
              for name, a, b in zip(("out", "x", "router weights", "w_gate_up", "w_down"), (got, *grads),
                                    (want, *want_grads))}
    assert all(e <= 4 * 2**-8 for e in errors.values()), errors


def test_torch_refuses_an_expanded_weight_by_name_before_any_gemm(monkeypatch):
    T, d, h, k, e = 40, 64, 32, 2, 4
    g = torch.Generator().manual_seed(3)
    rm = build_route_map(torch.randint(0, e, (T, k), generator=g).cuda(), e)
    x = torch.randn(T, d, generator=g).to("cuda", torch.bfloat16)
    router = torch.rand(T, k, generator=g).cuda()
    w1 = torch.randn(e, d, 2 * h, generator=g).to("cuda", torch.bfloat16)
    w2 = torch.randn(e, h, 1, generator=g).to("cuda", torch.bfloat16).expand(e, h, d)
    ran = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    with pytest.raises(ValueError, match=r"torch grouped_mm does not support .*an expand\(\)ed w, stride 0"):
        moe_ffn(x, rm, router, w1, w2, backend="torch")
    assert not ran, "a GEMM ran before the refusal"


DTYPES = [torch.uint8, torch.int32, torch.complex64, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_grouped_gemm_refuses_a_dtype_it_cannot_compute_in_on_the_gpu(backend, dtype):
    x = torch.ones(10, K, device="cuda").to(dtype)
    w = torch.ones(E, K, M, device="cuda").to(dtype)
    offsets = torch.tensor([2, 2, 5, 9, 10], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=rf"x and w are {dtype}: the grouped GEMM computes in"):
        grouped_gemm(x, w, offsets, backend=backend)
