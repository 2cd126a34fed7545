"""QA pass 35: moe-kernels used alone, with inputs the earlier passes did not use.

- Zero rows through torch's grouped_mm with the gradient `out.sum().backward()` hands in: an
  expanded [0, d] tensor with stride 0. A tensor with no elements counts as contiguous whatever
  its strides, so `.contiguous()` kept them and grouped_mm's backward raised "Invalid
  strides/sizes" (CPU `torch`/`auto` backends, and the GPU block plans that run grouped_mm).
- Expert ids in torch's unsigned shell dtypes (uint16/32/64) are integers, yet raised a
  NotImplementedError from inside the id check.
- AllToAllDispatcher: a route map over another number of experts on one EP rank raised on that
  rank alone, before the count exchange, so the other ranks waited in it until the process-group
  timeout (30 minutes by default).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_kernels import AllToAllDispatcher, build_route_map, grouped_gemm, moe_ffn, swiglu_experts

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402

E, D, H = 3, 16, 8  # fp32 rows of 64 / 32 bytes: torch's CPU grouped_mm takes them


def _empty_rows_leaves():
    return [torch.randn(0, D).requires_grad_(), torch.randn(E, D, 2 * H).requires_grad_(),
            torch.randn(E, H, D).requires_grad_()]


@pytest.mark.parametrize("backend", ["torch", "auto", "reference"])
def test_zero_rows_backward_from_a_sum_on_every_cpu_backend(backend):
    offsets = torch.zeros(E, dtype=torch.int32)
    x, w1, w2 = _empty_rows_leaves()
    out = grouped_gemm(x, w1, offsets, backend)
    assert out.shape == (0, 2 * H)
    out.sum().backward()  # the incoming gradient is an expanded [0, 2H] tensor with strides (0, 0)
    assert x.grad.shape == (0, D) and torch.count_nonzero(w1.grad) == 0

    x, w1, w2 = _empty_rows_leaves()
    out = swiglu_experts(x, w1, w2, offsets, backend)
    out.sum().backward()
    assert x.grad.shape == (0, D) and torch.count_nonzero(w1.grad) == 0 and torch.count_nonzero(w2.grad) == 0


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_zero_rows_backward_on_the_grouped_mm_block_plan(monkeypatch, backend):
    """The block plans a GPU runs (all GEMMs on grouped_mm under backend="torch"): the CPU stands in
    for the GPU (its grouped_mm has the same stride checks); with no rows no triton kernel launches."""
    pytest.importorskip("triton")
    import moe_kernels.triton as moe_triton
    from moe_kernels import expert_ffn
    from moe_kernels.triton.ffn_kernels import ALL_GROUPED_MM

    monkeypatch.setattr(moe_triton, "triton_runs_on", lambda t: True)
    monkeypatch.setattr(expert_ffn, "_time_plans", lambda *a, **k: ALL_GROUPED_MM)  # auto: as if it won the search
    monkeypatch.setattr(expert_ffn, "_PLANS", {})
    offsets = torch.zeros(E, dtype=torch.int32)
    x, w1, w2 = _empty_rows_leaves()
    assert expert_ffn._plan(backend, x, w1, w2, offsets) == ALL_GROUPED_MM
    out = swiglu_experts(x, w1, w2, offsets, backend)
    out.sum().backward()
    assert x.grad.shape == (0, D) and torch.count_nonzero(w1.grad) == 0 and torch.count_nonzero(w2.grad) == 0


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_expert_ids_route_like_int64_ones(dtype):
    g = torch.Generator().manual_seed(0)
    ids = torch.rand(11, 5, generator=g).topk(2, dim=1).indices
    want = build_route_map(ids, 5, backend="reference")
    for backend in ("reference", "torch", "auto"):
        got = build_route_map(ids.to(dtype), 5, backend=backend)
        for name in ("counts", "offsets", "sort_order", "dest_row"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (backend, name)
    too_big = ids.to(dtype)
    too_big[4, 1] = 7
    with pytest.raises(ValueError, match=r"expert_ids\[4, 1\]=7 is outside \[0, num_experts=5\)"):
        build_route_map(too_big, 5)
    # the whole block runs on them
    x, w = torch.randn(11, D, generator=g), torch.rand(11, 2, generator=g)
    w1, w2 = torch.randn(5, D, 2 * H, generator=g), torch.randn(5, H, D, generator=g)
    torch.testing.assert_close(moe_ffn(x, build_route_map(ids.to(dtype), 5), w, w1, w2),
                               moe_ffn(x, want, w, w1, w2, "reference"))


@pytest.mark.parametrize("dtype, num_experts, big_id", [(torch.uint8, 256, 200), (torch.uint8, 300, 255),
                                                      (torch.int8, 128, 127), (torch.int16, 40000, 30000)])
def test_narrow_integer_ids_are_checked_as_ids_when_num_experts_is_past_their_range(dtype, num_experts, big_id):
    """moe-kernels <= 0.9.12 compared the ids with num_experts in the ids' own dtype, where 256 wraps to 0 in uint8:
    uint8 ids of a 256-expert model were refused naming a valid id (review helper 154)."""
    ids = torch.tensor([[big_id, 1], [0, big_id], [3, 2]])
    want = build_route_map(ids, num_experts, backend="reference")
    for backend in ("reference", "torch", "auto"):
        got = build_route_map(ids.to(dtype), num_experts, backend=backend)
        for name in ("counts", "offsets", "sort_order", "dest_row"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (backend, name)
    if dtype.is_signed:  # and a negative one is still refused
        with pytest.raises(ValueError, match=r"expert_ids\[2, 1\]=-1 is outside"):
            build_route_map(torch.tensor([[0, 1], [2, 3], [4, -1]], dtype=dtype), num_experts)
    with pytest.raises(ValueError, match=r"expert_ids\[0, 0\]=9 is outside \[0, num_experts=9\)"):
        build_route_map(torch.tensor([[9, 1]], dtype=dtype), 9)  # past num_experts, within the dtype


# ---- AllToAllDispatcher: a route map over another E on one rank --------------------------------------
WORLD, DEADLINE_S = 2, 90


def _other_num_experts_on_rank1(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    res = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
        dispatcher = AllToAllDispatcher(dist.group.WORLD, 4)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(7, D, generator=g)
        num_experts = 8 if rank == 1 else 4  # rank 1 built its map over the wrong expert count
        ids = torch.randint(0, num_experts, (7, 2), generator=g)
        start = time.monotonic()
        try:
            dispatcher.dispatch(x, build_route_map(ids, num_experts))
            res["bad"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            res["bad"] = f"{type(e).__name__}: {e}"
        res["seconds"] = time.monotonic() - start
        # the group is still usable: a good dispatch on every rank goes through
        ids = torch.randint(0, 4, (7, 2), generator=g)
        result = dispatcher.dispatch(x, build_route_map(ids, 4))
        res["then_good"] = int(result.rows.shape[1])
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def test_route_map_over_another_num_experts_on_one_rank_raises_on_every_rank(tmp_path):
    results = kernels_spawn.results_without_errors(__file__, WORLD, tmp_path, DEADLINE_S,
                                                   entry="_other_num_experts_on_rank1")
    for r, res in enumerate(results):
        assert res["bad"].startswith("ValueError"), f"rank {r}: {res['bad']}"
        assert res["seconds"] < 10, f"rank {r} waited {res['seconds']:.1f} s (in the count exchange?)"
        assert res["then_good"] == D
    assert "route map has 8 experts, dispatcher expects 4" in results[1]["bad"]
    assert "EP rank 1" in results[0]["bad"]


def test_a_hand_built_route_map_with_int32_rows_holds_int64_ones():
    """sort_order / dest_row index rows times the row stride in their own dtype inside the kernels: a hand-built
    map's int32 ones are widened, so a big batch (past 2**31 elements) cannot wrap."""
    import moe_kernels as moe

    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    ref = moe.build_route_map(ids, 2, backend="reference")
    rm = moe.RouteMap(ref.num_tokens, ref.top_k, ref.num_experts, ref.counts, ref.offsets,
                      ref.sort_order.to(torch.int32), ref.dest_row.to(torch.int32))
    assert rm.sort_order.dtype == torch.int64 and rm.dest_row.dtype == torch.int64
    assert torch.equal(rm.sort_order, ref.sort_order) and torch.equal(rm.dest_row, ref.dest_row)
    x = torch.randn(3, 4)
    assert torch.equal(moe.permute(x, rm, backend="reference"), moe.permute(x, ref, backend="reference"))
