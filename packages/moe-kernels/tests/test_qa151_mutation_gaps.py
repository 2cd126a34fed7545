"""QA 151: checks a mutation audit of moe-kernels and moe-precision (review helper 167, 48 mutants, 12 survivors, 8 of
them real) found no test making. Each test fails on its mutant and passes on the code:
- the torch route map's sort made unstable (M02): rows of one expert out of (token, slot) order, unlike the triton
  backend's map;
- combine's row-count check dropped (M11): extra expert rows silently ignored;
- grouped_mm's support check reading a transposed weight's K for its M (M13);
- offsets with fewer entries than experts accepted (M15): the last expert's weights silently unused;
- an odd gate/up width failing inside the elementwise product (M19); the expert-count mismatch of moe_ffn named as a
  bare offsets shape (M20); a LocalDispatcher for 4 experts taking a map over 8 (M22);
- a negative capacity factor accepted as dropless (M34).
And the one bug it found (moe-kernels 0.9.14): a numpy float32 capacity factor was widened by float() before being read
as written, so np.float32(0.3) kept 31 of 100 rows where 0.3 keeps 30."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from moe_kernels import (
    AllToAllDispatcher,
    LocalDispatcher,
    build_route_map,
    combine,
    grouped_gemm,
    moe_ffn,
    swiglu_experts,
)
from moe_kernels.all_to_all import check_capacity_factor
from moe_kernels.grouped_gemm import torch_grouped_mm_supported

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402


def test_torch_route_map_is_stable_within_an_expert_at_1000_rows():
    """M02: torch.sort without stable=True reorders equal ids on the CPU at some sizes (1000 rows here)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (250, 4), generator=g)
    rm = build_route_map(ids, 8, backend="torch")
    flat = ids.reshape(-1)
    order = rm.sort_order
    assert torch.equal(flat[order], torch.sort(flat).values)
    same_expert = flat[order[1:]] == flat[order[:-1]]
    assert bool((order[1:] > order[:-1])[same_expert].all()), "rows of one expert are not in flat (token, slot) order"
    torch.testing.assert_close(rm.sort_order, torch.sort(flat, stable=True).indices, rtol=0, atol=0)


@pytest.mark.parametrize("extra", [1, 3])
def test_combine_refuses_expert_rows_more_than_t_times_k(extra):
    """M11: without the row-count check, extra rows were silently ignored."""
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    rm = build_route_map(ids, 3, backend="torch")
    out = torch.randn(rm.num_rows + extra, 4)
    w = torch.rand(3, 2)
    with pytest.raises(ValueError, match=r"expert_out has \d+ rows, expected T\*k=6"):
        combine(out, rm, w, backend="reference")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_mm_support_checks_the_output_width_of_a_transposed_weight():
    """M13: the 16-byte row check must look at M (w.shape[-1]); a transposed w whose K is aligned but M (3 fp32 =
    12 bytes) is not was reported supported (the stride check alone does not see M for a K-major w)."""
    E, K, M = 2, 8, 3
    x = torch.randn(6, K)
    w = torch.randn(E, M, K).transpose(-1, -2)  # [E, K, M], stride(-2) == 1
    assert not torch_grouped_mm_supported(x, w)
    with pytest.raises(ValueError, match="torch grouped_mm does not support"):
        grouped_gemm(x, w, torch.tensor([2, 6], dtype=torch.int32), backend="torch")


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_grouped_gemm_refuses_offsets_with_fewer_entries_than_experts(backend):
    """M15: offsets [E-1] ending at N passed the host checks and the last expert's weight was silently unused."""
    x = torch.randn(6, 4)
    w = torch.randn(3, 4, 4)
    with pytest.raises(ValueError, match=r"offsets shape \(2,\) != \(num_experts,\)=\(3,\)"):
        grouped_gemm(x, w, torch.tensor([2, 6], dtype=torch.int32), backend=backend)


def test_swiglu_experts_refuses_an_odd_gate_up_width():
    """M19: an odd 2h (gate and up of different widths) must be named, not fail inside the elementwise product."""
    x = torch.randn(4, 6)
    w_gate_up = torch.randn(2, 6, 5)
    w_down = torch.randn(2, 2, 6)
    with pytest.raises(ValueError, match=r"are not \[E, d, 2h\], \[E, h, d\]"):
        swiglu_experts(x, w_gate_up, w_down, torch.tensor([1, 4], dtype=torch.int32), backend="reference")


def test_moe_ffn_names_the_expert_count_mismatch():
    """M20: the route map's E against w_gate_up's E is named as such (else a bare offsets-shape message)."""
    rm = build_route_map(torch.tensor([[0, 1], [1, 2]]), 3, backend="torch")
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="the route map has 3 experts but w_gate_up has 4"):
        moe_ffn(x, rm, torch.rand(2, 2), torch.randn(4, 4, 8), torch.randn(4, 4, 4), backend="reference")


def test_local_dispatcher_refuses_a_route_map_over_other_experts():
    """M22: a LocalDispatcher for 4 experts handed a map over 8 returned offsets [8] for 4 experts' weights."""
    disp = LocalDispatcher(4)
    rm = build_route_map(torch.tensor([[0, 7], [5, 1]]), 8, backend="torch")
    with pytest.raises(ValueError, match="route map has 8 experts, dispatcher holds 4"):
        disp.dispatch(torch.randn(2, 4), rm)


@pytest.mark.parametrize("bad", [-0.5, -1, float("-inf")])
def test_a_negative_capacity_factor_is_refused(bad):
    """M34: a negative factor was accepted and silently meant dropless."""
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        check_capacity_factor(bad)


def test_a_numpy_float32_capacity_factor_is_read_as_written():
    """100 rows to one expert: ceil(0.3 * 100) = 30 kept, for 0.3 and np.float32(0.3) alike (31 before 0.9.14: float()
    widened the float32 to 0.30000001192092896 before it was read as written)."""
    np = pytest.importorskip("numpy")
    ids = torch.arange(100).remainder(4).view(50, 2)
    x = torch.randn(50, 8)
    with kernels_spawn.one_gloo_rank() as group:
        for factor in (0.3, np.float32(0.3), np.float32(1.1) / 4, np.float64(0.3)):
            res = AllToAllDispatcher(group, 4, capacity_factor=factor).dispatch(x, build_route_map(ids, 4))
            want = 30 if abs(float(factor) - 0.3) < 1e-6 else 28  # np.float32(1.1) / 4 reads 0.275: ceil(27.5)
            assert res.rows.shape[0] == want and int(res.dropped) == 100 - want, (factor, tuple(res.rows.shape))
