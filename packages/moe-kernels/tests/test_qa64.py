"""QA 64: a refused dispatch or combine lets its process group go as soon as the caller drops the error (2 gloo ranks).

The frames that raised a rank's own error on every rank (dispatch, combine and the collective checks they call) kept
it in a local variable, and that frame is on the error's traceback: error -> traceback -> frame -> error, a cycle
holding the dispatcher and its process group (and gloo's worker threads) until the next cyclic garbage collection.
A caller that caught the error, destroyed the group and exited could reach interpreter exit with the group alive,
where a gloo worker thread aborts the process (SIGABRT, pytorch#190489).

Each case runs with the garbage collector disabled on a gloo group of its own, catches and drops the error,
destroys the group, and checks weak references to the group and the dispatcher without calling gc.collect. A good
dispatch and combine is the control: it shows that a destroyed group held by nothing else is freed at once.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_kernels import AllToAllDispatcher, build_route_map

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402

pytestmark = pytest.mark.slow
WORLD, BAD = 2, 0  # rank BAD's inputs are damaged in the refused calls
E, K, D, T = 4, 2, 8, 5
COLLECTIVE_TIMEOUT_S = 30
DEADLINE_S = 120


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(T, D, generator=g), torch.randn(T, E, generator=g).topk(K, -1).indices


def _dispatch_and_combine(dispatcher: AllToAllDispatcher, rank: int, damage_route_map=None, damage_rows=None) -> None:
    """One dispatch and combine; on rank BAD the route map and the expert rows pass through the damage functions."""
    x, ids = _inputs(rank)
    route_map = build_route_map(ids, E)
    if damage_route_map is not None and rank == BAD:
        route_map = damage_route_map(ids, route_map)
    result = dispatcher.dispatch(x, route_map)
    expert_out = result.rows * 2
    if damage_rows is not None and rank == BAD:
        expert_out = damage_rows(expert_out)
    dispatcher.combine(expert_out, result, torch.ones(T, K))


def _another_num_experts(ids: torch.Tensor, route_map):  # noqa: ANN001, ANN202
    return build_route_map(ids, 2 * E)


def _one_count_more(ids: torch.Tensor, route_map):  # noqa: ANN001, ANN202
    counts = route_map.counts.clone()
    counts[0] += 1
    return dataclasses.replace(route_map, counts=counts)


def _one_row_short(rows: torch.Tensor) -> torch.Tensor:
    return rows[:-1]


# name: (ranks of the group, damage to the route map, damage to the expert rows)
CASES = {
    "good": ("pair", None, None),
    "dispatch_route_map_over_another_E": ("pair", _another_num_experts, None),
    "dispatch_counts_not_summing_to_rows": ("pair", _one_count_more, None),
    "combine_expert_rows_one_short": ("pair", None, _one_row_short),
    "dispatch_route_map_over_another_E_alone": ("alone", _another_num_experts, None),
    "combine_expert_rows_one_short_alone": ("alone", None, _one_row_short),
}


def _attempt(rank: int, ranks: str, damage_route_map, damage_rows) -> tuple[str, weakref.ref, weakref.ref]:
    """How the call ended, and weak references to its group and dispatcher, taken after the group was destroyed
    and the error dropped (nothing else in this frame, which is gone once it returns, holds them)."""
    if ranks == "pair":
        group = dist.new_group(list(range(WORLD)), backend="gloo")
    else:  # a group of this rank alone: the checks raise without any exchange
        group = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
    dispatcher = AllToAllDispatcher(group, E)
    try:
        _dispatch_and_combine(dispatcher, rank, damage_route_map, damage_rows)
        outcome = "ok"
    except ValueError as e:
        outcome = f"ValueError: {e}"  # `e` is unbound when the except clause ends: only the frames hold it now
    dist.destroy_process_group(group)
    return outcome, weakref.ref(group), weakref.ref(dispatcher)


def _cases(rank: int) -> dict:
    res = {}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name, (ranks, damage_route_map, damage_rows) in CASES.items():
            outcome, group, dispatcher = _attempt(rank, ranks, damage_route_map, damage_rows)
            res[name] = {"outcome": outcome, "group_freed": group() is None, "dispatcher_freed": dispatcher() is None}
            gc.collect()  # for the report only: whether a reference cycle held them (freed now) or something else
            res[name]["freed_by_gc"] = group() is None and dispatcher() is None
            dist.barrier()  # rank 0 hosts the store a group of one rank is made through: it stays until all are done
    finally:
        if was_enabled:
            gc.enable()
    return res


def _entry(rank: int, port: int, out_dir: str) -> None:
    kernels_spawn.run_gloo_rank(rank, port, out_dir, WORLD, COLLECTIVE_TIMEOUT_S, _cases)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return kernels_spawn.results_without_errors(__file__, WORLD, tmp_path_factory.mktemp("qa64"), DEADLINE_S)


def _check_freed(ranks: list[dict], name: str) -> None:
    for rank, res in enumerate(ranks):
        case = res[name]
        assert case["group_freed"] and case["dispatcher_freed"], (
            f"rank {rank}, {name}: after the error was dropped and the group destroyed, the group is "
            f"{'freed' if case['group_freed'] else 'alive'} and the dispatcher "
            f"{'freed' if case['dispatcher_freed'] else 'alive'} without the garbage collector "
            f"({'freed by gc.collect(): a reference cycle' if case['freed_by_gc'] else 'alive after gc.collect() too'})"
            f"; the call ended with {case['outcome']}")


def test_a_good_dispatch_and_combine_leave_nothing_holding_the_destroyed_group(ranks):
    """The control: what the refused cases check is measured right (nothing else keeps a destroyed group)."""
    assert [res["good"]["outcome"] for res in ranks] == ["ok"] * WORLD
    _check_freed(ranks, "good")


# what the rank at fault raises (its own error); the other rank of a pair raises a ValueError quoting it
RANK_AT_FAULT_SAYS = {
    "dispatch_route_map_over_another_E": "ValueError: route map has 8 experts, dispatcher expects 4",
    "dispatch_counts_not_summing_to_rows": "ValueError: route map counts",
    "combine_expert_rows_one_short": "ValueError: expert_out has",
    "dispatch_route_map_over_another_E_alone": "ValueError: route map has 8 experts, dispatcher expects 4",
    "combine_expert_rows_one_short_alone": "ValueError: expert_out has",
}


@pytest.mark.parametrize("name", sorted(RANK_AT_FAULT_SAYS))
def test_a_refused_call_frees_its_group_once_the_error_is_dropped_without_the_garbage_collector(ranks, name):
    assert ranks[BAD][name]["outcome"].startswith(RANK_AT_FAULT_SAYS[name]), ranks[BAD][name]["outcome"]
    if not name.endswith("_alone"):
        other = ranks[1 - BAD][name]["outcome"]
        assert other.startswith("ValueError: ") and f"EP rank {BAD}: ValueError: " in other, other
    _check_freed(ranks, name)
