"""The parallel layout: data, expert and pipeline parallel sizes, and where each rank sits.

Ranks are laid out pipeline-stage major: rank = pp_rank * dp + dp_rank. Inside a stage's
data-parallel ranks, expert parallelism is folded over data parallelism in contiguous blocks:
dp_rank = edp_rank * ep + ep_rank. So ep can grow without touching the attention layout, and an
expert-parallel group is ep neighbouring ranks (one node on a GPU cluster).

Validation is pure arithmetic on plain ints: every rank computes the same message and raises
before any process group, buffer or collective exists, so a bad layout never hangs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in the layout."""

    rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    edp_rank: int  # index among the replicas of this rank's expert shard


@dataclass(frozen=True)
class ParallelLayout:
    """dp: data-parallel size (per pipeline stage); ep: expert-parallel size (divides dp); pp: stages."""

    dp: int = 1
    ep: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: how many ranks hold the same expert shard."""
        return self.dp // self.ep

    def validate(self, world_size: int, num_experts: int) -> ParallelLayout:
        """Raise ValueError naming the offending value; return self when the layout fits.

        num_experts: experts per MoE layer (0 for a dense model).
        """
        for name in ("dp", "ep", "pp"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"parallel layout: {name}={value!r} must be a positive integer")
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"parallel layout: world_size={world_size!r} must be a positive integer")
        if not _is_int(num_experts) or num_experts < 0:
            raise ValueError(
                f"parallel layout: num_experts={num_experts!r} must be a non-negative integer (0 for a dense model)"
            )
        if self.dp * self.pp != world_size:
            # no dp fits when pp does not divide the world ("set dp=?" named no value to use)
            fix = (f"set dp={world_size // self.pp}" if world_size % self.pp == 0 else
                   f"world_size={world_size} is not a multiple of pp={self.pp}, so no dp fits: "
                   "set pp to a divisor of it")
            raise ValueError(
                f"parallel layout: dp={self.dp} x pp={self.pp} = {self.dp * self.pp} does not equal "
                f"world_size={world_size}; {fix} (dp * pp must be the number of processes)"
            )
        if self.dp % self.ep != 0:
            raise ValueError(
                f"parallel layout: ep={self.ep} does not divide dp={self.dp} "
                f"(expert parallelism is folded over the data-parallel ranks)"
            )
        if self.ep > 1 and num_experts == 0:
            raise ValueError(
                f"parallel layout: ep={self.ep} with a dense model (num_experts=0): there are no experts to split "
                "over expert-parallel ranks; use ep=1"
            )
        if self.ep > 1 and (num_experts <= 0 or num_experts % self.ep != 0):
            raise ValueError(
                f"parallel layout: num_experts={num_experts} is not divisible by ep={self.ep} "
                f"(every expert-parallel rank must hold the same number of experts)"
            )
        return self

    def coords(self, rank: int) -> RankCoords:
        if not _is_int(rank):  # "1" failed on `<=`, naming nothing; 1.0 gave float coordinates
            try:  # numpy's integers (and a 0-dim integer tensor) are ones: operator.index takes them
                index = None if isinstance(rank, bool) else operator.index(rank)
            except TypeError:
                index = None
            if index is None:
                raise ValueError(f"rank={rank!r}: expected an integer in [0, {self.world_size})")
            rank = index
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size})")
        pp_rank, dp_rank = divmod(rank, self.dp)
        edp_rank, ep_rank = divmod(dp_rank, self.ep)
        return RankCoords(rank, pp_rank, dp_rank, ep_rank, edp_rank)

    # Rank lists of every group, in one fixed order (all ranks build groups in this order).
    def dp_groups(self) -> list[list[int]]:
        return [[s * self.dp + d for d in range(self.dp)] for s in range(self.pp)]

    def ep_groups(self) -> list[list[int]]:
        return [
            [s * self.dp + r * self.ep + e for e in range(self.ep)] for s in range(self.pp) for r in range(self.edp)
        ]

    def edp_groups(self) -> list[list[int]]:
        return [
            [s * self.dp + r * self.ep + e for r in range(self.edp)] for s in range(self.pp) for e in range(self.ep)
        ]

    def pp_groups(self) -> list[list[int]]:
        return [[s * self.dp + d for s in range(self.pp)] for d in range(self.dp)]


def _is_int(value: object) -> bool:
    """An int that is not a bool (True is an int to Python, never a layout size here)."""
    return isinstance(value, int) and not isinstance(value, bool)
