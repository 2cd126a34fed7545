"""QA 148: AllToAllDispatcher's capacity is ceil(c * T * k) rows also when c * T * k is not a whole number. A mutation
audit (review helper 161) changed the ceil to a floor and no test noticed: every tested capacity made c * T * k whole.
A floor would keep one row fewer than documented and count one more as dropped."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from moe_kernels import AllToAllDispatcher, build_route_map

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402


def test_a_fractional_capacity_keeps_ceil_of_c_t_k_rows_and_counts_the_rest_dropped():
    g = torch.Generator().manual_seed(148)
    with kernels_spawn.one_gloo_rank() as group:
        # 3 tokens, top-1, all to expert 0: ceil(1.5) = 2, ceil(1.02) = 2, ceil(0.9999999999999999) = 1 (1/3 as
        # written, 0.3333333333333333), ceil(2.7) = 3
        for tokens, top_k, experts, c, kept in ((3, 1, 2, 0.5, 2), (3, 1, 2, 0.34, 2), (3, 1, 2, 1 / 3, 1),
                                                (3, 1, 2, 0.9, 3), (7, 2, 4, 0.3, 5), (7, 2, 4, 0.55, 8)):
            ids = torch.zeros(tokens, top_k, dtype=torch.int64)
            if top_k > 1:
                ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
            x = torch.randn(tokens, 4, generator=g)
            res = AllToAllDispatcher(group, experts, capacity_factor=c).dispatch(x, build_route_map(ids, experts))
            assert res.rows.shape[0] == kept, (tokens, top_k, c, tuple(res.rows.shape))
            assert int(res.dropped) == tokens * top_k - kept, (tokens, top_k, c, int(res.dropped))
            assert int(res.offsets[-1]) == kept, (c, res.offsets.tolist())
