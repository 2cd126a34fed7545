"""Independent QA (4 gloo ranks, one spawn, ~15 s on 2 cores): build_groups with pipeline stages (pp > 1: the
seam, groups only) gives every rank the dp / ep / edp / pp groups the layout describes, and expert-parallel
dispatch inside each stage's EP group matches one process holding that group's tokens (a rank with none);
a world that pp does not divide is refused on every rank with a message saying so (it said "set dp=?");
capacity_factor that is no number (None, "1", True) is refused by apply_expert_parallel and
AllToAllDispatcher with a ValueError naming it (a bare TypeError, or True taken as a capacity of 1.0)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("qa53_worker")
parallel_spawn = importlib.import_module("parallel_spawn")

WORLD = 4
DEADLINE_S = 120

# rank -> (its groups' members); rank = pp_rank * dp + dp_rank, dp_rank = edp_rank * ep + ep_rank
GROUPS = {
    "dp2_ep2_pp2": {"dp": [[0, 1], [0, 1], [2, 3], [2, 3]], "ep": [[0, 1], [0, 1], [2, 3], [2, 3]],
                    "edp": [[0], [1], [2], [3]], "pp": [[0, 2], [1, 3], [0, 2], [1, 3]]},
    "dp2_ep1_pp2": {"dp": [[0, 1], [0, 1], [2, 3], [2, 3]], "ep": [[0], [1], [2], [3]],
                    "edp": [[0, 1], [0, 1], [2, 3], [2, 3]], "pp": [[0, 2], [1, 3], [0, 2], [1, 3]]},
    "dp1_pp4": {"dp": [[0], [1], [2], [3]], "ep": [[0], [1], [2], [3]], "edp": [[0], [1], [2], [3]],
                "pp": [[0, 1, 2, 3]] * 4},
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return parallel_spawn.run_ranks(worker.run_rank, WORLD, tmp_path_factory.mktemp("qa53"), DEADLINE_S)


@pytest.mark.parametrize("layout", sorted(GROUPS))
def test_groups_with_pipeline_stages_hold_the_ranks_the_layout_names_and_ep_dispatch_matches_one_process(
        ranks, layout):
    for r, res in enumerate(ranks):
        got = res[layout]
        for kind, members in GROUPS[layout].items():
            assert got[kind] == (members[r], float(sum(members[r]))), f"rank {r} {kind}: {got[kind]}"
        assert got["coords"].rank == r
        assert max(got["errors"]) < 1e-5, f"rank {r}: out, x, w_gate_up, w_down errors {got['errors']}"


def test_a_world_that_pp_does_not_divide_is_refused_on_every_rank_saying_so(ranks):
    for r, res in enumerate(ranks):
        assert res["world_not_a_multiple_of_pp"] == (
            "ValueError: parallel layout: dp=1 x pp=3 = 3 does not equal world_size=4; world_size=4 is not a "
            "multiple of pp=3, so no dp fits: set pp to a divisor of it (dp * pp must be the number of processes)"
        ), f"rank {r}: {res['world_not_a_multiple_of_pp']}"
        assert res["ep_not_dividing_dp"] == (
            "ValueError: parallel layout: ep=3 does not divide dp=4 (expert parallelism is folded over the "
            "data-parallel ranks)"), f"rank {r}: {res['ep_not_dividing_dp']}"


@pytest.mark.parametrize(("name", "shown"), [("none", "None"), ("str", "'1'"), ("bool", "True")])
def test_a_capacity_factor_that_is_no_number_is_refused_naming_it(ranks, name, shown):
    want = f"ValueError: capacity_factor={shown} must be a finite number >= 0 (0 = dropless)"
    for r, res in enumerate(ranks):
        assert res["capacity"][f"apply_{name}"] == want, f"rank {r}: {res['capacity'][f'apply_{name}']}"
        assert res["capacity"][f"dispatcher_{name}"] == want, f"rank {r}: {res['capacity'][f'dispatcher_{name}']}"
