"""Layout arithmetic and validation: pure ints, no process group."""

from __future__ import annotations

import pytest

from moe_parallel import ParallelLayout


def test_layout_folds_expert_parallelism_inside_data_parallelism():
    layout = ParallelLayout(dp=4, ep=2, pp=2)
    assert layout.world_size == 8 and layout.edp == 2
    assert layout.dp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.ep_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.edp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    c = layout.coords(6)
    assert (c.pp_rank, c.dp_rank, c.ep_rank, c.edp_rank) == (1, 2, 0, 1)


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    layout = ParallelLayout(dp=8, ep=4, pp=1)
    for groups in (layout.dp_groups(), layout.ep_groups(), layout.edp_groups(), layout.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))


@pytest.mark.parametrize(
    ("layout", "world", "experts", "message"),
    [
        (ParallelLayout(2, 1, 1), 4, 8, "dp=2 x pp=1 = 2 does not equal world_size=4"),
        (ParallelLayout(4, 3, 1), 4, 6, "ep=3 does not divide dp=4"),
        (ParallelLayout(4, 4, 1), 4, 6, "num_experts=6 is not divisible by ep=4"),
        (ParallelLayout(2, 2, 1), 2, 0, "num_experts=0 is not divisible by ep=2"),
        (ParallelLayout(0, 1, 1), 0, 8, "dp=0 must be a positive integer"),
    ],
)
def test_invalid_layout_raises_a_message_naming_the_value(layout, world, experts, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout.validate(world, experts)


def test_valid_layouts_pass():
    for dp, ep in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4)):
        assert ParallelLayout(dp, ep).validate(dp, 8).dp == dp
