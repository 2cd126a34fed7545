"""EP ranks whose AllToAllDispatchers split different numbers of experts (2 gloo ranks).

The count exchange is [ep, E/ep + header] int64 per rank, so a rank built with another num_experts sent
another size and gloo aborted the processes (SIGABRT, no Python error). The first dispatch now checks
that every rank's num_experts agrees and raises the same ValueError on every rank; a dispatcher that
agrees pays that check once.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_kernels import AllToAllDispatcher, build_route_map

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402

WORLD = 2
D = 8
DEADLINE_S = 90
COLLECTIVE_TIMEOUT_S = 15


def _entry(rank: int, port: int, out_dir: str) -> None:
    kernels_spawn.run_gloo_rank(rank, port, out_dir, WORLD, COLLECTIVE_TIMEOUT_S, _cases)


def _dispatch_outcome(dispatcher: AllToAllDispatcher, num_experts: int) -> str:
    x = torch.randn(5, D)
    ids = torch.randint(0, num_experts, (5, 2))
    try:
        result = dispatcher.dispatch(x, build_route_map(ids, num_experts))
    except ValueError as e:
        return f"ValueError: {e}"
    return f"ran: {tuple(result.rows.shape)}"


def _cases(rank: int) -> dict:
    torch.manual_seed(rank)
    res = {}
    mismatched = 4 if rank == 0 else 8  # rank 1 counts 4 local experts, rank 0 two
    res["mismatched"] = _dispatch_outcome(AllToAllDispatcher(dist.group.WORLD, mismatched), mismatched)
    agreed = AllToAllDispatcher(dist.group.WORLD, 4)
    res["agreed"] = [_dispatch_outcome(agreed, 4) for _ in range(2)]
    return res


@pytest.mark.slow
def test_ep_ranks_with_different_num_experts_raise_on_every_rank(tmp_path):
    results = kernels_spawn.results_without_errors(__file__, WORLD, tmp_path, DEADLINE_S)
    for rank, res in enumerate(results):
        text = res["mismatched"]
        assert text.startswith("ValueError: EP ranks disagree on the experts they split"), (rank, text)
        assert "EP rank 0: num_experts=4; EP rank 1: num_experts=8" in text, (rank, text)
        assert all(outcome.startswith("ran") for outcome in res["agreed"]), (rank, res["agreed"])
