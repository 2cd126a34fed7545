"""The standalone-API fixes (tests/test_standalone_qa.py) on the GPU paths the CPU cannot reach:
torch grouped_mm's stride rule and int32 offsets, the triton kernels with strided offsets, and a
CUDA-graph capture of a block whose hand-built route map holds strided tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_kernels import build_route_map, grouped_gemm, moe_ffn, permute
from moe_kernels.grouped_gemm import grouped_gemm_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T, D, H, E, K = 333, 256, 128, 16, 2


@pytest.fixture(scope="module")
def block():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    weights, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K, dim=-1)
    w1 = (torch.randn(E, D, 2 * H, device="cuda", generator=g) * D**-0.5).bfloat16()
    w2 = (torch.randn(E, H, D, device="cuda", generator=g) * H**-0.5).bfloat16()
    rm = build_route_map(ids, E)
    ref = moe_ffn(x.float(), rm, weights, w1.float(), w2.float(), "reference")
    return x, weights, w1, w2, rm, ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def strided(t: torch.Tensor) -> torch.Tensor:
    view = torch.stack([t, torch.zeros_like(t)], 1)[:, 0]
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_int64_offsets_of_a_hand_built_map_run_every_plan(block, backend):
    x, weights, w1, w2, rm, ref = block
    rm64 = dataclasses.replace(rm, counts=rm.counts.long(), offsets=rm.offsets.long())
    assert rel_err(moe_ffn(x, rm64, weights, w1, w2, backend), ref) < 1e-2


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_strided_offsets_give_the_same_rows(block, backend):
    x, weights, w1, w2, rm, ref = block
    rows = permute(x, rm)
    assert torch.equal(grouped_gemm(rows, w1, strided(rm.offsets), backend), grouped_gemm(rows, w1, rm.offsets, backend))


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_weights_with_unit_stride_in_either_last_dim_run_and_sliced_ones_run_under_auto(block, backend):
    x, weights, w1, w2, rm, ref = block
    rows = permute(x, rm)
    transposed = w1.transpose(1, 2).contiguous().transpose(1, 2)
    sliced = torch.randn(E, D, 4 * H, device="cuda").bfloat16()[..., ::2]
    for w in (transposed, sliced):
        if backend == "torch" and w is sliced:
            with pytest.raises(ValueError, match="torch grouped_mm does not support .* unit stride"):
                grouped_gemm(rows, w, rm.offsets, backend)
            continue
        want = grouped_gemm_reference(rows.float(), w.float(), rm.offsets)
        assert rel_err(grouped_gemm(rows, w, rm.offsets, backend), want) < 1e-2


def test_a_block_with_a_strided_hand_built_route_map_captures_in_a_cuda_graph(block):
    x, weights, w1, w2, rm, ref = block
    rm_s = dataclasses.replace(rm, offsets=strided(rm.offsets), dest_row=strided(rm.dest_row))
    moe_ffn(x, rm_s, weights, w1, w2, "auto")  # warm-up: tuning and the plan search happen outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_ffn(x, rm_s, weights, w1, w2, "auto")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_ffn(x, rm_s, weights, w1, w2, "auto")
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, ref) < 1e-2


def test_a_second_derivative_through_the_triton_block_is_refused(block):
    x, weights, w1, w2, rm, ref = block
    xg = x.clone().requires_grad_()
    out = moe_ffn(xg, rm, weights, w1, w2, "triton")
    with pytest.raises(RuntimeError, match="SwigluFFNFn: the triton backend's backward is not differentiable"):
        torch.autograd.grad(out.float().square().sum(), xg, create_graph=True)
