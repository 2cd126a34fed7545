"""moe-kernels used alone, as another training stack calls it: findings of a standalone QA pass.

Each test names the property a user relies on and failed before its fix: offsets or a hand-built
route map given as strided views, rows with no experts, empty K / M / d / h, expert weights that
torch grouped_mm cannot read as laid out, backend="torch" refusing before any GEMM runs, counts
that are not integers, a route map on another device than the rows, LocalDispatcher handed a
foreign result, and grouped_gemm_reference with offsets that are not cumulative row ends.

The checks under Triton's interpreter run once, in one subprocess (this file run as a script:
TRITON_INTERPRET must be set before triton is imported), and report one verdict per check.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from moe_kernels import (
    LocalDispatcher,
    build_route_map,
    combine,
    grouped_gemm,
    grouped_gemm_reference,
    moe_ffn,
    permute,
    swiglu_experts,
)

sys.path.insert(0, str(Path(__file__).parent))
import interpreter_checks  # noqa: E402

try:
    import numpy  # noqa: F401  (the interpreter runs on numpy)
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

CPU_BACKENDS = ["reference", "torch", "auto"]
gg_module = importlib.import_module("moe_kernels.grouped_gemm")  # the package's `grouped_gemm` is the function


def problem(T=9, d=16, h=8, E=5, k=2, seed=0, empty=(2,)):
    """Fresh random routing with an empty expert; fp32 sizes torch's CPU grouped_mm takes."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    ids = allowed[torch.rand(T, len(allowed), generator=g).topk(k, dim=1).indices]
    x = torch.randn(T, d, generator=g)
    weights = torch.rand(T, k, generator=g)
    w1 = torch.randn(E, d, 2 * h, generator=g) / d**0.5
    w2 = torch.randn(E, h, d, generator=g) / h**0.5
    return ids, x, weights, w1, w2


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a wider tensor)."""
    return torch.stack([t, t], dim=-1)[..., 0]


def strided_route_map(rm):
    """A route map as another dispatcher may build it: its index tensors are strided views."""
    return dataclasses.replace(
        rm, offsets=strided(rm.offsets), sort_order=strided(rm.sort_order), dest_row=strided(rm.dest_row)
    )


# -- offsets and hand-built route maps given as strided views ---------------------------------------


@pytest.mark.parametrize("backend", ["torch", "auto"])  # triton: the interpreter checks below
def test_grouped_gemm_takes_offsets_that_are_a_strided_view(backend):
    """torch grouped_mm raised "Offsets must have stride (1,)"; the triton kernels read a strided
    view as a flat array and picked wrong experts (the interpreter check below)."""
    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5)
    rows = permute(x, rm)
    offs = strided(rm.offsets)
    assert not offs.is_contiguous()
    torch.testing.assert_close(grouped_gemm(rows, w1, offs, backend), grouped_gemm_reference(rows, w1, rm.offsets))
    torch.testing.assert_close(
        swiglu_experts(rows, w1, w2, offs, backend), swiglu_experts(rows, w1, w2, rm.offsets, "reference")
    )


def test_a_hand_built_route_map_holds_contiguous_index_tensors():
    ids, *_ = problem()
    rm = strided_route_map(build_route_map(ids, 5))
    for name in ("counts", "offsets", "sort_order", "dest_row"):
        assert getattr(rm, name).is_contiguous(), name


# -- rows with no experts, and empty K / M / d / h -------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "auto"])  # the reference loop refused them already
def test_rows_without_any_expert_are_refused(backend):
    """E = 0 with rows to compute returned uninitialised memory on torch grouped_mm (and triton)."""
    x, w = torch.randn(3, 16), torch.randn(0, 16, 4)
    with pytest.raises(ValueError, match=r"there are 3 rows but no experts \(E=0\)"):
        grouped_gemm(x, w, torch.zeros(0, dtype=torch.int32), backend)
    assert grouped_gemm(x[:0], w, torch.zeros(0, dtype=torch.int32), backend).shape == (0, 4)


@pytest.mark.parametrize("backend", ["torch", "auto"])  # the reference loop handled them already
def test_empty_inner_or_output_dims_give_zeros_on_every_backend(backend):
    """K = 0, M = 0 (and d = 0 or h = 0 in the block) crashed inside torch grouped_mm ("strides
    should be multiple of 16 bytes") or the triton launch ("K=0 is not supported")."""
    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5)
    n = rm.num_rows
    xk = torch.zeros(n, 0, requires_grad=True)
    wk = torch.zeros(5, 0, 4, requires_grad=True)
    out = grouped_gemm(xk, wk, rm.offsets, backend)
    assert out.shape == (n, 4) and torch.count_nonzero(out) == 0
    out.sum().backward()
    assert xk.grad.shape == (n, 0) and wk.grad.shape == (5, 0, 4)
    assert grouped_gemm(torch.randn(n, 16), torch.randn(5, 16, 0), rm.offsets, backend).shape == (n, 0)
    h0 = moe_ffn(x, rm, weights, w1[..., :0], w2[:, :0], backend)  # h = 0: every expert outputs zeros
    assert h0.shape == x.shape and torch.count_nonzero(h0) == 0
    assert moe_ffn(x[:, :0], rm, weights, w1[:, :0], w2[..., :0], backend).shape == (x.shape[0], 0)  # d = 0
    assert swiglu_experts(torch.randn(n, 16), w1[..., :0], w2[:, :0], rm.offsets, backend).shape == (n, 16)


# -- expert weights laid out so that torch grouped_mm cannot read them --------------------------------


def test_weights_grouped_mm_cannot_read_run_elsewhere_under_auto_and_are_named_under_torch():
    """w[..., ::2] (no unit stride in its last two dims) crashed auto and torch with grouped_mm's
    "Invalid strides/sizes"."""
    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5)
    rows = permute(x, rm)
    w1s = torch.stack([w1, w1], dim=-1)[..., 0]  # [E, d, 2h] with strides (.., .., 2)
    w2s = torch.stack([w2, w2], dim=-1)[..., 0]
    torch.testing.assert_close(grouped_gemm(rows, w1s, rm.offsets, "auto"), grouped_gemm_reference(rows, w1, rm.offsets))
    torch.testing.assert_close(moe_ffn(x, rm, weights, w1s, w2s, "auto"), moe_ffn(x, rm, weights, w1, w2, "reference"))
    message = r"torch grouped_mm does not support .* \(strides \(\d+, \d+, 2\)\).*unit stride in one of its last two dims"
    with pytest.raises(ValueError, match=message):
        grouped_gemm(rows, w1s, rm.offsets, "torch")
    with pytest.raises(ValueError, match=message):
        moe_ffn(x, rm, weights, w1s, w2s, "torch")
    # a transposed layout (unit stride in K) is one grouped_mm reads: it stays on grouped_mm
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(grouped_gemm(rows, w1t, rm.offsets, "torch"), grouped_gemm_reference(rows, w1, rm.offsets))


def test_backend_torch_refuses_an_unsupported_second_gemm_before_any_gemm_runs(monkeypatch):
    """h = 6 in fp32 (24-byte rows): the first GEMM suits grouped_mm, the second does not. The
    refusal came after the first GEMM had run."""
    calls = []
    real = gg_module.grouped_gemm_torch
    monkeypatch.setattr(gg_module, "grouped_gemm_torch", lambda *a: calls.append(1) or real(*a))
    ids, x, weights, w1, w2 = problem(h=6)
    rm = build_route_map(ids, 5)
    for call in (
        lambda: swiglu_experts(permute(x, rm), w1, w2, rm.offsets, "torch"),
        lambda: moe_ffn(x, rm, weights, w1, w2, "torch"),
    ):
        with pytest.raises(ValueError, match=r"torch grouped_mm does not support x torch\.float32 .\d+, 6."):
            call()
    assert calls == []


# -- counts that are not integers, devices, foreign results ----------------------------------------


@pytest.mark.parametrize("bad", [4.0, 4.5, True, "4", 0, -1])
def test_num_experts_must_be_a_positive_integer(bad):
    """build_route_map(ids, 4.0) failed inside torch.zeros, True was taken as 1 expert, "4" raised
    a TypeError; LocalDispatcher took 0 or 4.0 experts without a word."""
    ids = torch.tensor([[0, 1], [2, 3]])
    message = re.escape(f"num_experts={bad!r} must be a positive integer")
    with pytest.raises(ValueError, match=message):
        build_route_map(ids, bad)  # 0 and -1 were refused here before, as "must be positive"
    with pytest.raises(ValueError, match=message):
        LocalDispatcher(bad)


def test_integer_like_counts_are_taken_as_plain_ints():
    ids = torch.tensor([[0, 1], [2, 3]])
    np = pytest.importorskip("numpy")
    for four in (np.int64(4), torch.tensor(4)):
        rm = build_route_map(ids, four)
        assert type(rm.num_experts) is int and rm.num_experts == 4
        assert LocalDispatcher(four).num_local_experts == 4
    rm = build_route_map(ids, 4)
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match=re.escape(f"ep_size={bad!r} must be a positive integer")):
            rm.rank_counts(bad)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_route_map_on_another_device_than_the_rows_is_refused(backend):
    """permute / combine silently indexed rows on one device with a route map from another."""
    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5)
    meta = x.to("meta")
    with pytest.raises(ValueError, match="the route map is on device=cpu but x is on device=meta"):
        permute(meta, rm, backend)
    rows = torch.empty(rm.num_rows, x.shape[1], device="meta")
    with pytest.raises(ValueError, match="the route map is on device=cpu but expert_out is on device=meta"):
        combine(rows, rm, weights.to("meta"), backend)
    with pytest.raises(ValueError, match="the route map is on device=cpu but x is on device=meta"):
        moe_ffn(meta, rm, weights.to("meta"), w1.to("meta"), w2.to("meta"), backend)


def test_local_dispatcher_combine_refuses_a_result_it_did_not_hand_out():
    """A DispatchResult from another transport died with an AttributeError deep in combine."""
    from moe_kernels import DispatchResult

    ids, x, weights, *_ = problem()
    rm = build_route_map(ids, 5)
    disp = LocalDispatcher(5)
    res = disp.dispatch(x, rm)
    foreign = DispatchResult(res.rows, res.offsets, context={"send_splits": [18]}, dropped=res.dropped)
    with pytest.raises(ValueError, match="result.context is a dict: pass the DispatchResult of this dispatcher's dispatch"):
        disp.combine(res.rows, foreign, weights)


# -- the public reference checks its operands like grouped_gemm ----------------------------------------


def test_grouped_gemm_reference_refuses_offsets_that_are_not_cumulative_row_ends():
    """[3, 2, 9, 11] over 11 rows returned 12 rows (x[3:2] is empty, x[2:9] read rows twice)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(11, 8, generator=g), torch.randn(4, 8, 16, generator=g)
    with pytest.raises(ValueError, match=r"offsets \[3, 2, 9, 11\] must be non-decreasing cumulative row ends"):
        grouped_gemm_reference(x, w, torch.tensor([3, 2, 9, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="x has K=8 but w has K=4"):
        grouped_gemm_reference(x, w[:, :4], torch.tensor([3, 3, 9, 11], dtype=torch.int32))


# -- the same under Triton's interpreter (backend="triton" on the CPU) -------------------------------


def _interp_strided_offsets():
    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5, backend="triton")
    rows = permute(x, rm, backend="reference")
    offs = strided(rm.offsets)
    torch.testing.assert_close(grouped_gemm(rows, w1, offs, "triton"), grouped_gemm_reference(rows, w1, rm.offsets))
    torch.testing.assert_close(
        swiglu_experts(rows, w1, w2, offs, "triton"), swiglu_experts(rows, w1, w2, rm.offsets, "reference")
    )


def _interp_strided_route_map():
    ids, x, weights, w1, w2 = problem()
    ref = build_route_map(ids, 5, backend="reference")
    rm = dataclasses.replace(
        ref, offsets=strided(ref.offsets), sort_order=strided(ref.sort_order), dest_row=strided(ref.dest_row)
    )
    rows = permute(x, ref, backend="reference")
    torch.testing.assert_close(permute(x, rm, backend="triton"), rows, rtol=0, atol=0)
    torch.testing.assert_close(combine(rows, rm, weights, "triton"), combine(rows, ref, weights, "reference"))
    torch.testing.assert_close(moe_ffn(x, rm, weights, w1, w2, "triton"), moe_ffn(x, ref, weights, w1, w2, "reference"))


def _interp_hand_built_offsets_checked():
    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5, backend="triton")
    bad = dataclasses.replace(rm, offsets=torch.tensor([3, 2, 9, 11, 18], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offsets \[3, 2, 9, 11, 18\] must be non-decreasing cumulative row ends"):
        moe_ffn(x, bad, weights, w1, w2, "triton")


def _interp_int64_offsets_on_grouped_mm_plan():
    """A hand-built map with int64 offsets (e.g. from torch.cumsum) on a block plan with grouped_mm
    GEMMs, as backend="torch" runs on a GPU: grouped_mm raised "Offsets have to be int32"."""
    import moe_kernels.triton as moe_triton

    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5, backend="reference")
    rm64 = dataclasses.replace(rm, counts=rm.counts.long(), offsets=rm.offsets.long())
    saved = moe_triton.triton_runs_on
    moe_triton.triton_runs_on = lambda t: True  # the CPU stands in for the GPU: auto/torch take the block plans
    try:
        out = moe_ffn(x, rm64, weights, w1, w2, "torch")
    finally:
        moe_triton.triton_runs_on = saved
    torch.testing.assert_close(out, moe_ffn(x, rm, weights, w1, w2, "reference"))


def _interp_empty_dims():
    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5, backend="triton")
    n = rm.num_rows
    out = grouped_gemm(torch.zeros(n, 0), torch.zeros(5, 0, 4), rm.offsets, "triton")
    assert out.shape == (n, 4) and torch.count_nonzero(out) == 0
    h0 = moe_ffn(x, rm, weights, w1[..., :0], w2[:, :0], "triton")
    assert h0.shape == x.shape and torch.count_nonzero(h0) == 0
    assert moe_ffn(x[:, :0], rm, weights, w1[:, :0], w2[..., :0], "triton").shape == (x.shape[0], 0)


def _interp_rows_without_experts():
    with pytest.raises(ValueError, match=r"there are 3 rows but no experts \(E=0\)"):
        grouped_gemm(torch.randn(3, 16), torch.randn(0, 16, 4), torch.zeros(0, dtype=torch.int32), "triton")


def _interp_double_backward_refused():
    """The triton backwards build no graph: create_graph=True must raise, not return first-order-only grads."""
    ids, x, weights, w1, w2 = problem()
    rm = build_route_map(ids, 5, backend="triton")
    rows = permute(x, rm, backend="reference").requires_grad_()
    x, weights, w1 = x.requires_grad_(), weights.requires_grad_(), w1.requires_grad_()
    calls = {
        "GroupedGemmFn": lambda: grouped_gemm(rows, w1, rm.offsets, "triton"),
        "PermuteFn": lambda: permute(x, rm, backend="triton"),
        "CombineFn": lambda: combine(rows, rm, weights, "triton"),
        "SwigluFFNFn": lambda: moe_ffn(x, rm, weights, w1, w2, "triton"),
    }
    for name, call in calls.items():
        out = call()
        torch.autograd.grad(out.square().sum(), [t for t in (x, rows, weights, w1) if t.requires_grad],
                            allow_unused=True, retain_graph=True)  # first order still fine
        with pytest.raises(RuntimeError, match=f"{name}: the triton backend's backward is not differentiable"):
            torch.autograd.grad(out.square().sum(), [t for t in (x, rows, weights, w1) if t.requires_grad],
                                allow_unused=True, create_graph=True)


INTERPRETER_CHECKS = {
    "double_backward_refused": _interp_double_backward_refused,
    "strided_offsets": _interp_strided_offsets,
    "strided_route_map": _interp_strided_route_map,
    "hand_built_offsets_checked": _interp_hand_built_offsets_checked,
    "int64_offsets_on_grouped_mm_plan": _interp_int64_offsets_on_grouped_mm_plan,
    "empty_dims": _interp_empty_dims,
    "rows_without_experts": _interp_rows_without_experts,
}


@pytest.mark.skipif(not HAVE_TRITON, reason="triton or numpy (its interpreter needs it) is not installed")
@pytest.mark.parametrize("check", list(INTERPRETER_CHECKS))
def test_triton_backend_under_the_interpreter(interpreter_verdicts, check):
    assert interpreter_verdicts[check]["verdict"] == "ok", interpreter_verdicts[check]["verdict"]


if __name__ == "__main__":
    interpreter_checks.run_checks(INTERPRETER_CHECKS)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_combine_refuses_integer_expert_rows(backend):
    """int32 expert rows came back as the weighted sum truncated to int32 (weights of 0.3 and 0.7 gave 0 for 1s)."""
    ids, x, weights, *_ = problem()
    rm = build_route_map(ids, 5)
    rows = torch.ones(rm.num_rows, x.shape[1], dtype=torch.int32)
    with pytest.raises(ValueError, match="expert_out must be floating point .* got dtype=torch.int32"):
        combine(rows, rm, weights, backend)
