"""Input checks found missing by QA round 4: dtypes the Triton kernels take, router weights,
top_k = 0 and rows that are not 2-D.

The checks under Triton's interpreter run in a subprocess (this file run as a script), since
TRITON_INTERPRET must be set before triton is imported.
"""

import os

import pytest
import torch

import moe_kernels.triton as moe_triton
from moe_kernels import build_route_map, combine, grouped_gemm, moe_ffn, permute, swiglu_experts

try:
    import numpy  # noqa: F401  (the interpreter runs on numpy)
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

T, d, h, E, k = 5, 8, 4, 3, 2
CPU_BACKENDS = ["reference", "torch", "auto"]


def problem(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    rm = build_route_map(ids, E, backend="reference")
    x = torch.randn(T, d, generator=g, dtype=dtype)
    weights = torch.rand(T, k, generator=g, dtype=dtype)
    w1 = torch.randn(E, d, 2 * h, generator=g, dtype=dtype) / d**0.5
    w2 = torch.randn(E, h, d, generator=g, dtype=dtype) / h**0.5
    return rm, x, weights, w1, w2


# -- finding 1: the Triton kernels compute in fp32, so they take fp32 / bf16 / fp16 only ----------

FP64_MESSAGE = r"backend='triton' got dtype=torch\.float64: the triton kernels take torch\.float32, torch\.bfloat16, torch\.float16"


def fp64_triton_calls(rm, x, weights, w1, w2):
    rows = x[rm.source_token]
    return {
        "permute": lambda: permute(x, rm, backend="triton"),
        "combine": lambda: combine(rows, rm, weights, backend="triton"),
        "grouped_gemm": lambda: grouped_gemm(rows, w1, rm.offsets, backend="triton"),
        "swiglu_experts": lambda: swiglu_experts(rows, w1, w2, rm.offsets, backend="triton"),
        "moe_ffn": lambda: moe_ffn(x, rm, weights, w1, w2, backend="triton"),
    }


def test_triton_backend_refuses_float64_naming_the_dtypes_it_takes(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for call in fp64_triton_calls(*problem(torch.float64)).values():
        with pytest.raises(ValueError, match=FP64_MESSAGE):
            call()


def test_auto_runs_float64_on_the_torch_path_where_triton_would_run(monkeypatch):
    """As on a CUDA device with triton installed (`triton_runs_on` true): fp32, bf16, fp16 and
    integer ids go to the kernels, float64 stays on the torch / reference path, exact in float64
    (the stand-in device is the CPU, where reaching a kernel without the interpreter would fail)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(moe_triton, "triton_runs_on", lambda t: True)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32):
        assert moe_triton.use_triton("auto", torch.zeros(2, 2, dtype=dtype)), dtype
    for dtype in (torch.float64, torch.complex64):
        assert not moe_triton.use_triton("auto", torch.zeros(2, 2, dtype=dtype)), dtype
    rm, x, weights, w1, w2 = problem(torch.float64)
    torch.testing.assert_close(
        moe_ffn(x, rm, weights, w1, w2, backend="auto"), moe_ffn(x, rm, weights, w1, w2, backend="reference"), rtol=0, atol=0
    )
    leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    assert torch.autograd.gradcheck(lambda a, b, c, e: moe_ffn(a, rm, b, c, e, backend="auto"), leaves, fast_mode=True)


# -- finding 2: router weights are floating point, on x's device ------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_router_weights_that_are_not_floating_point_are_refused(backend, dtype):
    rm, x, weights, w1, w2 = problem()
    bad = torch.ones(T, k, dtype=dtype)
    message = f"router weights must be a floating-point tensor, got dtype={dtype}"
    with pytest.raises(ValueError, match=message):
        moe_ffn(x, rm, bad, w1, w2, backend=backend)
    with pytest.raises(ValueError, match=message):
        combine(x[rm.source_token], rm, bad, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_router_weights_on_another_device_than_x_are_refused(backend):
    rm, x, weights, w1, w2 = problem()
    meta = torch.empty_like(weights, device="meta")
    message = "router weights are on device=meta but the rows are on device=cpu"
    with pytest.raises(ValueError, match=message):
        moe_ffn(x, rm, meta, w1, w2, backend=backend)
    with pytest.raises(ValueError, match=message):
        combine(x[rm.source_token], rm, meta, backend=backend)
    with pytest.raises(ValueError, match="router weights are on device=cpu but the rows are on device=meta"):
        combine(torch.empty(T * k, d, device="meta"), rm, weights, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_router_weights_in_another_float_dtype_than_x_keep_working(backend):
    """fp32 router weights with bf16 rows (the model's mix) and float64 weights with fp32 rows
    (moe_ffn on bf16 skips "torch": its CPU grouped_mm takes fp32 only)."""
    rm, x, weights, w1, w2 = problem()
    for x_dtype, w_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float64)):
        xs, ws = x.to(x_dtype), weights.to(w_dtype)
        if not (backend == "torch" and x_dtype == torch.bfloat16):
            out = moe_ffn(xs, rm, ws, w1.to(x_dtype), w2.to(x_dtype), backend=backend)
            assert out.dtype == x_dtype and out.shape == (T, d)
        rows = xs[rm.source_token]
        torch.testing.assert_close(combine(rows, rm, ws, backend=backend), combine(rows, rm, ws, backend="reference"))


# -- finding 3: top_k = 0 and rows that are not 2-D --------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_route_map_refuses_zero_columns_of_expert_ids(backend):
    for num_tokens in (T, 0):
        with pytest.raises(ValueError, match=r"expert_ids has 0 columns .*: top_k must be >= 1"):
            build_route_map(torch.zeros(num_tokens, 0, dtype=torch.long), E, backend=backend)
    assert build_route_map(torch.zeros(0, k, dtype=torch.long), E, backend=backend).num_rows == 0  # T = 0 stays fine


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rows_that_are_not_2d_are_refused(backend):
    rm, x, weights, w1, w2 = problem()
    with pytest.raises(ValueError, match=r"x must be 2-D \[T, d\], got shape \(5,\)"):
        permute(torch.randn(T), rm, backend=backend)
    with pytest.raises(ValueError, match=r"x must be 2-D \[T, d\], got shape \(5, 2, 8\)"):
        permute(torch.randn(T, 2, d), rm, backend=backend)
    with pytest.raises(ValueError, match=r"expert_out must be 2-D \[T\*k, d\], got shape \(10, 1, 8\)"):
        combine(torch.randn(T * k, 1, d), rm, weights, backend=backend)
    with pytest.raises(ValueError, match=r"x must be 2-D \[T, d\], got shape \(5, 1, 8\)"):
        moe_ffn(x[:, None], rm, weights, w1, w2, backend=backend)
    with pytest.raises(ValueError, match=r"x_sorted must be 2-D \[N, d\], got shape \(10, 1, 8\)"):
        swiglu_experts(x[rm.source_token][:, None], w1, w2, rm.offsets, backend=backend)


# -- the same under Triton's interpreter (backend="triton" on the CPU) -------------------------------


def _check_under_interpreter():
    # finding 1: fp64 refused by every op; the three dtypes the kernels take are accepted
    rm, x, weights, w1, w2 = problem(torch.float64)
    for call in fp64_triton_calls(rm, x, weights, w1, w2).values():
        with pytest.raises(ValueError, match=FP64_MESSAGE):
            call()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert moe_triton.use_triton("triton", torch.zeros(2, 2, dtype=dtype))
    # finding 2: bad router weights named; fp64 weights with fp32 rows still run on the kernels
    rm, x, weights, w1, w2 = problem()
    rows = x[rm.source_token]
    for bad, message in (
        (torch.ones(T, k, dtype=torch.long), "router weights must be a floating-point tensor, got dtype=torch.int64"),
        (torch.ones(T, k, dtype=torch.bool), "router weights must be a floating-point tensor, got dtype=torch.bool"),
        (torch.empty(T, k, device="meta"), "router weights are on device=meta but the rows are on device=cpu"),
    ):
        with pytest.raises(ValueError, match=message):
            moe_ffn(x, rm, bad, w1, w2, backend="triton")
        with pytest.raises(ValueError, match=message):
            combine(rows, rm, bad, backend="triton")
    w64 = weights.double().requires_grad_()
    out = combine(rows, rm, w64, backend="triton")
    torch.testing.assert_close(out, combine(rows, rm, w64.detach(), backend="reference"))
    out.sum().backward()
    assert w64.grad.dtype == torch.float64
    # finding 3: top_k = 0 refused before the kernels divide by it; rows must be 2-D
    with pytest.raises(ValueError, match=r"expert_ids has 0 columns .*: top_k must be >= 1"):
        build_route_map(torch.zeros(T, 0, dtype=torch.long), E, backend="triton")
    for bad in (torch.randn(T), torch.randn(T, 2, d)):
        with pytest.raises(ValueError, match=r"x must be 2-D \[T, d\]"):
            permute(bad, rm, backend="triton")
    with pytest.raises(ValueError, match=r"x must be 2-D \[T, d\]"):
        moe_ffn(x[:, None], rm, weights, w1, w2, backend="triton")
    with pytest.raises(ValueError, match=r"expert_out must be 2-D \[T\*k, d\]"):
        combine(rows[:, None], rm, weights, backend="triton")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_offsets_on_another_device_than_the_rows_are_refused(backend):
    rm, x, weights, w1, w2 = problem()
    rows = x[rm.source_token]
    offsets = rm.offsets.to("meta")
    with pytest.raises(ValueError, match="offsets are on device=meta but the rows are on device=cpu"):
        grouped_gemm(rows, w1, offsets, backend=backend)
    with pytest.raises(ValueError, match="offsets are on device=meta"):
        swiglu_experts(rows, w1, w2, offsets, backend=backend)


def test_a_route_map_built_by_hand_is_held_to_build_route_maps_shapes():
    import dataclasses

    rm, *_ = problem()
    with pytest.raises(ValueError, match="expected num_tokens >= 0, top_k >= 1"):
        dataclasses.replace(rm, top_k=0)
    with pytest.raises(ValueError, match=r"RouteMap.sort_order has shape \(10,\), expected \(15,\)"):
        dataclasses.replace(rm, top_k=3)
    with pytest.raises(ValueError, match=r"RouteMap.counts has shape \(3,\), expected \(4,\)"):
        dataclasses.replace(rm, num_experts=4)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton or numpy (its interpreter needs it) is not installed")
def test_input_checks_hold_under_the_triton_interpreter(run_under_interpreter):
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(2)
    _check_under_interpreter()
    print("ok")
