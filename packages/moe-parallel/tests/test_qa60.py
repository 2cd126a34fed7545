"""Independent QA 60 (2 gloo ranks, one spawn, ~15 s on 2 cores): a check that FlatParams or DistributedAdamW
makes on one rank alone (mixed dtypes, a frozen parameter, no parameters, one FlatParams given twice) refused
that rank only, and the other rank waited in the collective check that follows until the refusing rank's
process died ("Connection closed by peer") or the collective timed out. Now every rank raises at once, the
others naming the refusing rank and its message, and the group stays usable."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("qa60_worker")
parallel_spawn = importlib.import_module("parallel_spawn")

WORLD = 2
DEADLINE_S = 120
PROMPT_S = 3.0  # the check's own timeout is 6 s: a rank that waited for the other takes at least that long

REFUSALS = {
    "flat_dtype": "ValueError: parameters of one group must share a dtype, got ['torch.float32', 'torch.float64']",
    "flat_frozen": "ValueError: FlatParams got parameters with requires_grad=False: ['b']",
    "flat_empty": "ValueError: FlatParams needs at least one parameter",
    "optimizer_flat_twice": "ValueError: DistributedAdamW: the parameter 'b' of flats[1] is also 'b' of flats[0]",
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return parallel_spawn.run_ranks(worker.run_rank, WORLD, tmp_path_factory.mktemp("qa60"), DEADLINE_S)


def test_workers_import_the_code_under_test(ranks):
    import moe_parallel

    assert {r["moe_parallel_file"] for r in ranks} == {moe_parallel.__file__}


@pytest.mark.parametrize("key", sorted(REFUSALS))
def test_a_refusal_on_one_rank_fails_every_rank_at_once_naming_that_rank(ranks, key):
    mine, other = ranks[1][key], ranks[0][key]
    assert mine["outcome"].startswith(REFUSALS[key]), mine["outcome"]
    what = ("DistributedAdamW: the config and the parameters (expert parameters as this rank's slice)"
            if key.startswith("optimizer") else "FlatParams: the parameters")
    want = f"ValueError: {what}: rank 1 refused them ({REFUSALS[key]}"
    assert other["outcome"].startswith(want), other["outcome"]
    assert other["seconds"] < PROMPT_S, f"rank 0 waited {other['seconds']:.1f} s for rank 1"


def test_ranks_with_different_shapes_still_name_the_first_difference(ranks):
    for r, res in enumerate(ranks):
        assert res["flat_shape"]["outcome"].startswith(
            "ValueError: FlatParams: the parameters differ across ranks: rank 0 has 'b' (3, 2) torch.float32 where "
            "rank 1 has 'b' (2, 3) torch.float32"), f"rank {r}: {res['flat_shape']['outcome']}"


def test_the_group_stays_usable_after_a_refusal(ranks):
    # FlatParams broadcasts the group's first rank's weights: rank 1's 1.0s become rank 0's 0.0s
    assert [res["still_usable"].get("w") for res in ranks] == [[0.0] * 4] * 2, [res["still_usable"] for res in ranks]
