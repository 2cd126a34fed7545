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
    world: every rank (global norms, metrics), with build_groups' timeout
    dp_forward: the dp ranks in a communicator of their own, for collectives inside the model's forward (the
        router's load-balance counts). Activation checkpointing re-runs those during backward while GradientSync's
        reductions are in flight on dp; on one group the two kinds would pair up out of order across ranks (a rank
        that launched a bucket early, a parameter unused there, against one that holds it until finish()).
        None in groups built by hand: the forward's collectives then share dp.
    """

    layout: ParallelLayout
    coords: RankCoords
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    edp: dist.ProcessGroup
    pp: dist.ProcessGroup
    world: dist.ProcessGroup
    dp_forward: dist.ProcessGroup | None = None

    @property
    def rank(self) -> int:
        return self.coords.rank

    @property
    def forward_group(self) -> dist.ProcessGroup:
        """The group for collectives inside the model's forward: dp_forward, or dp in groups built without it."""
        return self.dp_forward if self.dp_forward is not None else self.dp


def build_groups(layout: ParallelLayout, num_experts: int, timeout: timedelta | None = None) -> ParallelGroups:
    """Create every group of `layout` with torch.distributed.new_group; call on every rank.

    The default process group must be initialised with world_size == layout.world_size.
    timeout: how long a collective on these groups may wait before it fails (torch's default when None); `world`
    is then a group of every rank made with it, not the default group (whose timeout init_process_group set), and
    build_groups' own check that every rank passed the same layout runs on it too (a late rank fails it in `timeout`).
    new_group is collective over the world, so every rank creates every group in the same order
    and keeps the ones that contain it.
    """
    world_size = dist.get_world_size()
    # made first, so that the agreement check below (a late rank, a wrong layout) waits `timeout`, not the default
    # group's; the same call on every rank whatever its layout
    world = dist.group.WORLD if timeout is None else _new_group(list(range(world_size)), timeout, "world")
    # Every rank must create the same groups in the same order: a rank given another layout (or expert count) would
    # make other new_group calls, and the ranks wait in them until the store times out (torch's default: 30 minutes).
    what, device = "build_groups: the layout and num_experts", collective_device(world)
    try:
        layout.validate(world_size, num_experts)
    except ValueError as refusal:  # on this rank only when the ranks were given different values
        require_same_on_every_rank(world, [], what, device, refusal)
        raise
    require_same_on_every_rank(world, [repr(layout), f"num_experts={num_experts!r}"], what, device,
                               expected="every rank to pass the same layout and num_experts")
    coords = layout.coords(dist.get_rank())
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, rank_lists in (
        ("dp", layout.dp_groups()),
        ("ep", layout.ep_groups()),
        ("edp", layout.edp_groups()),
        ("pp", layout.pp_groups()),
        ("dp_forward", layout.dp_groups()),
    ):
        for ranks in rank_lists:
            group = _new_group(ranks, timeout, kind)
            if coords.rank in ranks:
                mine[kind] = group
    return ParallelGroups(layout, coords, mine["dp"], mine["ep"], mine["edp"], mine["pp"], world, mine["dp_forward"])


def _new_group(ranks: list[int], timeout: timedelta | None, kind: str) -> dist.ProcessGroup:
    """dist.new_group, its rendezvous failing (the store's "wait timeout after 2000ms, keys: /default_pg/0//1//cpu//0/1"
    or gloo's connect timeout, which name no group and no cause) raised again, of the same type, saying which group
    and what usually causes it. Any other error (a backend that cannot start here, out of memory) is raised as is."""
    try:
        return dist.new_group(ranks, timeout=timeout)
    except RuntimeError as err:
        if not _is_rendezvous_timeout(err):
            raise
        waited = "torch's default timeout" if timeout is None else f"timeout={timeout.total_seconds():g} s"
        message = (f"build_groups: rank {dist.get_rank()} of {dist.get_world_size()} could not create the {kind} group "
                   f"of ranks {ranks} ({waited}): the ranks did not all reach it in time; one of them is late or "
                   "stopped, or passed build_groups another timeout (None on one rank and a value on another make "
                   f"different groups); the backend said: {type(err).__name__}: {err}")
        try:
            again = type(err)(message)  # a caller catching DistStoreError / DistError still does
        except Exception:  # noqa: BLE001 - a type that takes no message: the plain one
            again = RuntimeError(message)
        raise again from err


def _is_rendezvous_timeout(err: RuntimeError) -> bool:
    """The store timing out on a rank that never wrote its key, or gloo failing to connect to a peer."""
    if isinstance(err, getattr(dist, "DistStoreError", ())):
        return True
    text = str(err).lower()
    return "connect" in text and ("timeout" in text or "timed out" in text or "refused" in text)
