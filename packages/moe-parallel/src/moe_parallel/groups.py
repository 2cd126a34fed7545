"""Process groups built from a layout, handed around as one object (no hidden globals)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from moe_parallel.buffers import collective_device, require_same_on_every_rank
from moe_parallel.layout import ParallelLayout, RankCoords


@dataclass
class ParallelGroups:
    """The groups this rank belongs to.

    dp:  dense data parallelism (dense gradients are reduced here)
    ep:  expert parallelism (token rows travel here)
    edp: expert data parallelism (expert gradients are reduced here; size dp / ep)
    pp:  pipeline stages (same dp_rank, one rank per stage)
    world: every rank (global norms, metrics)
    """

    layout: ParallelLayout
    coords: RankCoords
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    edp: dist.ProcessGroup
    pp: dist.ProcessGroup
    world: dist.ProcessGroup

    @property
    def rank(self) -> int:
        return self.coords.rank


def build_groups(layout: ParallelLayout, num_experts: int, timeout: timedelta | None = None) -> ParallelGroups:
    """Create every group of `layout` with torch.distributed.new_group; call on every rank.

    The default process group must be initialised with world_size == layout.world_size.
    timeout: how long a collective on these groups may wait before it fails (torch's default when None).
    new_group is collective over the world, so every rank creates every group in the same order
    and keeps the ones that contain it.
    """
    world_size = dist.get_world_size()
    # Every rank must create the same groups in the same order: a rank given another layout (or expert count) would
    # make other new_group calls, and the ranks wait in them until the store times out (torch's default: 30 minutes).
    what, device = "build_groups: the layout and num_experts", collective_device(dist.group.WORLD)
    try:
        layout.validate(world_size, num_experts)
    except ValueError as refusal:  # on this rank only when the ranks were given different values
        require_same_on_every_rank(dist.group.WORLD, [], what, device, refusal)
        raise
    require_same_on_every_rank(dist.group.WORLD, [repr(layout), f"num_experts={num_experts!r}"], what, device,
                               expected="every rank to pass the same layout and num_experts")
    coords = layout.coords(dist.get_rank())
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, rank_lists in (
        ("dp", layout.dp_groups()),
        ("ep", layout.ep_groups()),
        ("edp", layout.edp_groups()),
        ("pp", layout.pp_groups()),
    ):
        for ranks in rank_lists:
            group = dist.new_group(ranks, timeout=timeout)
            if coords.rank in ranks:
                mine[kind] = group
    return ParallelGroups(layout, coords, mine["dp"], mine["ep"], mine["edp"], mine["pp"], dist.group.WORLD)
