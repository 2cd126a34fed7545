"""QA 41: inputs the other tests never tried.

- One expert whose offsets are a strided view (`offs2d[:, j]` with E = 1), and a single row whose
  row stride is not its width (`x.T` of a [d, 1] column): both count as contiguous in torch (a dim
  of size 1 may have any stride), so `.contiguous()` kept them as they were and torch's grouped_mm
  refused them ("Offsets must have stride (1,)", "strides should be multiple of 16 bytes") under
  `torch` and `auto` on the CPU, while `reference` ran them.
- AllToAllDispatcher with rows that need gradients on one EP rank and not on another (a rank with
  no tokens whose x is a fresh `torch.empty(0, d)`, or a rank that skips its experts when it received
  no rows): the forward ran, then the backward's reverse row exchange ran on one rank only and paired
  with the peer's next collective (garbage headers, or a gloo abort). Now every rank raises a
  ValueError before any row moves, and the dispatcher goes on working afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_kernels import AllToAllDispatcher, build_route_map, grouped_gemm, swiglu_experts

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402

K, M = 16, 8


@pytest.mark.parametrize("backend", ["torch", "auto", "reference"])
def test_grouped_gemm_takes_a_strided_offsets_view_with_one_expert(backend):
    x, w = torch.randn(5, K, requires_grad=True), torch.randn(1, K, M, requires_grad=True)
    per_layer = torch.tensor([[5, 5]], dtype=torch.int32)  # [E=1, layers]: column 0 is a view of stride 2
    offsets = per_layer[:, 0]
    assert offsets.stride() == (2,)
    y = grouped_gemm(x, w, offsets, backend)
    torch.testing.assert_close(y, x @ w[0])
    y.square().sum().backward()
    torch.testing.assert_close(w.grad[0], x.detach().t() @ (2 * y.detach()))


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_single_row_with_a_unit_row_stride_matches_the_reference(backend):
    g = torch.Generator().manual_seed(41)
    column = torch.randn(K, 1, generator=g)
    w1, w2 = torch.randn(2, K, 2 * M, generator=g), torch.randn(2, M, K, generator=g)
    offsets = torch.tensor([0, 1], dtype=torch.int32)  # the one row belongs to expert 1
    results = []
    for b in (backend, "reference"):
        x = column.clone().t().requires_grad_()  # [1, K] with strides (1, 1): "contiguous"
        assert x.stride() == (1, 1) and x.is_contiguous()
        a, c = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = swiglu_experts(x, a, c, offsets, b)
        y.square().sum().backward()
        results.append((grouped_gemm(x.detach(), a.detach(), offsets, b), y, x.grad, a.grad, c.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


# ---- EP ranks that disagree on whether their rows need gradients (2 gloo ranks) -------------------
WORLD = 2
D, H, E = 16, 8, 4  # experts 0, 1 on EP rank 0; 2, 3 on EP rank 1
DEADLINE_S = 90
COLLECTIVE_TIMEOUT_S = 15


def _entry(rank: int, port: int, out_dir: str) -> None:
    kernels_spawn.run_gloo_rank(rank, port, out_dir, WORLD, COLLECTIVE_TIMEOUT_S, _grad_disagreement)


def _outcome(fn) -> str:  # noqa: ANN001
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    return "ran"


def _grad_disagreement(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    w1 = torch.randn(E // WORLD, D, 2 * H, generator=g).requires_grad_()
    w2 = torch.randn(E // WORLD, H, D, generator=g).requires_grad_()
    disp = AllToAllDispatcher(dist.group.WORLD, E)
    res = {}

    # (a) rank 1 has no tokens and builds its x fresh, without requires_grad
    x = torch.randn(3, D, generator=g).requires_grad_() if rank == 0 else torch.empty(0, D)
    ids = torch.randint(0, E, (x.shape[0], 2), generator=g)
    res["dispatch"] = _outcome(lambda: disp.dispatch(x, build_route_map(ids, E)))  # forward only: no backward to pair

    # (b) every token goes to rank 0's experts; rank 1 received no rows and skips its experts
    x = torch.randn(3, D, generator=g).requires_grad_()
    ids, weights = torch.tensor([[0, 1]] * 3), torch.rand(3, 2, generator=g)
    r = disp.dispatch(x, build_route_map(ids, E))
    y = swiglu_experts(r.rows, w1, w2, r.offsets) if rank == 0 else r.rows.new_zeros(0, D)
    res["combine"] = _outcome(lambda: disp.combine(y, r, weights))

    # (c) after both refusals the dispatcher goes on: forward and backward on every rank
    ids = torch.randint(0, E, (3, 2), generator=g)
    r = disp.dispatch(x, build_route_map(ids, E))
    out = disp.combine(swiglu_experts(r.rows, w1, w2, r.offsets), r, weights)
    out.square().sum().backward()
    res["after"] = "ran" if x.grad is not None and bool(torch.isfinite(x.grad).all()) else "no gradient"
    return res


def _spawn(out_dir: Path) -> list[dict]:
    return kernels_spawn.results_or_fail(kernels_spawn.spawn(__file__, WORLD, out_dir, DEADLINE_S), DEADLINE_S)


@pytest.mark.slow
def test_ep_ranks_that_disagree_on_gradients_raise_on_every_rank_before_any_row_moves(tmp_path):
    results = _spawn(tmp_path)
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}: {res.get('error')}\n{res.get('traceback')}"
        assert res["dispatch"].startswith("ValueError") and "need gradients" in res["dispatch"], (rank, res)
        assert "EP rank 0: rows need gradients" in res["dispatch"], (rank, res)
        assert res["combine"].startswith("ValueError") and "need gradients" in res["combine"], (rank, res)
        assert res["after"] == "ran", (rank, res)
