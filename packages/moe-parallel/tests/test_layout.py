"""Layout arithmetic and validation: pure ints, no process group."""

from __future__ import annotations

import pytest

from moe_parallel import ParallelGroups, ParallelLayout


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
        (ParallelLayout(2, 2, 1), 2, 0, "ep=2 with a dense model (num_experts=0): there are no experts to split"),
        (ParallelLayout(0, 1, 1), 0, 8, "dp=0 must be a positive integer"),
    ],
)
def test_invalid_layout_raises_a_message_naming_the_value(layout, world, experts, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout.validate(world, experts)


def test_valid_layouts_pass():
    for dp, ep in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4)):
        assert ParallelLayout(dp, ep).validate(dp, 8).dp == dp


def test_expert_names_of_a_model_that_is_itself_the_moe_layer_match_its_parameter_names():
    """apply_expert_parallel's shard keys and expert_parameter_names spell names as
    named_parameters() does, also for a root MoE layer (no leading dot)."""
    import torch
    from torch import nn

    from moe_kernels import LocalDispatcher
    from moe_parallel import apply_expert_parallel, expert_parameter_names

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 3, 2))
            self.inner = nn.Linear(2, 3)  # weight [3, 2]: not one row per expert

    layer = nn.Module()
    layer.num_experts, layer.experts, layer.dispatcher = 4, Experts(), LocalDispatcher(4)
    layer.router = nn.Linear(3, 4)
    layout = ParallelLayout()
    groups = ParallelGroups(layout, layout.coords(0), None, None, None, None, None)
    with pytest.raises(ValueError, match=r"experts.inner.weight has shape \(3, 2\), expected num_experts=4 rows"):
        apply_expert_parallel(layer, groups)
    del layer.experts.inner
    shards = apply_expert_parallel(layer, groups)
    names = {n for n, _ in layer.named_parameters()}
    assert set(shards) == expert_parameter_names(layer) == {"experts.w"} and set(shards) <= names


def test_forward_group_is_dp_forward_and_falls_back_to_dp_in_groups_built_by_hand():
    layout = ParallelLayout()
    dp, dp_forward = object(), object()  # stand-ins: the property only chooses between them
    by_hand = ParallelGroups(layout, layout.coords(0), dp, None, None, None, None)
    built = ParallelGroups(layout, layout.coords(0), dp, None, None, None, None, dp_forward)
    assert by_hand.forward_group is dp and built.forward_group is dp_forward
