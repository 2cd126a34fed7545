"""DistributedAdamW's sharded state in global coordinates, for checkpoints that load on any parallel layout.

A rank holds, per FlatParams bucket, one contiguous shard of fp32 masters and AdamW moments; a shard may cut
through parameters, and an expert parameter is only this rank's rows of [E, ...]. Each piece here is one
parameter's part of one such shard, placed in the row-major flattened *global* tensor (all E experts), so what
one layout saves another can read back, whatever its dp, ep or bucket sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_parallel.buffers import FlatParams, ParamSlot

if TYPE_CHECKING:
    from moe_parallel.optimizer import _ShardState

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True, eq=False)  # eq=False: compared by identity (a tensor field has no truth value)
class OptimizerStatePiece:
    """One parameter's elements [offset, offset + numel) of one optimizer state tensor, held on this rank.

    name: the parameter's name, as given to FlatParams.
    key: "master" (the fp32 master weights), "exp_avg" or "exp_avg_sq" (AdamW's first and second moments).
    global_shape: the parameter's global shape; for an expert-parallel slice all E experts, [E, ...].
    offset: the first element of this piece in the row-major flattened global tensor of global_shape.
    tensor: [numel] fp32 (fp64 for fp64 weights), a view into the optimizer's own state: reading it saves,
        writing into it (copy_) loads.
    owner: True on exactly one rank per element across the world: the rank that saves it. The other ranks
        holding the element (replicas of an unsharded FlatParams) still write it when loading.
    """

    name: str
    key: str
    global_shape: tuple[int, ...]
    offset: int
    tensor: torch.Tensor
    owner: bool

    @property
    def numel(self) -> int:
        return self.tensor.numel()


def state_pieces(flats: list[FlatParams], states: list[list[_ShardState]]) -> list[OptimizerStatePiece]:
    """The pieces of every bucket shard: flat by flat, bucket by bucket, parameter by parameter, then the keys
    in STATE_KEYS order. Padding between parameters belongs to no piece."""
    out: list[OptimizerStatePiece] = []
    for flat, flat_states in zip(flats, states):
        for bucket, st in zip(flat.buckets, flat_states):
            lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_numel
            for slot in bucket.slots:
                a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
                if a >= b:
                    continue
                global_shape, base = _global_place(slot)
                for key, tensor in zip(STATE_KEYS, (st.master, st.exp_avg, st.exp_avg_sq)):
                    out.append(OptimizerStatePiece(slot.name, key, global_shape, base + a - slot.start,
                                                   tensor[a - lo : b - lo], flat.owns_unique_shard))
    return out


def _global_place(slot: ParamSlot) -> tuple[tuple[int, ...], int]:
    """(global shape, flat offset of the local tensor's first element in it): an expert slice (marked by
    apply_expert_parallel with its ExpertShard) starts at its first row; any other parameter is whole."""
    shard = getattr(slot.param, "expert_shard", None)
    if shard is None:
        return slot.shape, 0
    global_shape, rows = tuple(shard.global_shape), slot.shape[0] if slot.shape else 0
    if (len(global_shape) != len(slot.shape) or global_shape[1:] != slot.shape[1:] or shard.row_offset < 0
            or shard.row_offset + rows > global_shape[0]):
        raise ValueError(f"{slot.name!r} {slot.shape} is marked as rows [{shard.row_offset}, "
                         f"{shard.row_offset + rows}) of {global_shape}; expected a block of rows of that shape")
    return global_shape, shard.row_offset * math.prod(slot.shape[1:])
