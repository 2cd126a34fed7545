"""Expert-parallel token dispatch over torch.distributed.all_to_all_single.

Experts are split contiguously over the `ep` ranks of `group`: expert e lives on EP rank
e // (E / ep). Dispatch permutes (token, slot) rows into global expert order (so each
destination rank's rows are contiguous), exchanges per-expert counts with an all-to-all of a
small device tensor, sends the rows, and reorders what arrives into local-expert order.

Host synchronisation: all_to_all_single needs its split sizes as host ints, so the count matrix
makes exactly one device->host copy per dispatch (send counts and receive counts in one tensor).
Combine reuses those sizes and needs none. A row-wise NVSHMEM transport removes the copy.

Capacity (optional): with capacity_factor c > 0 a rank computes at most ceil(c * T * k) received
rows; rows past the cap in local-expert order (higher local experts, then higher source ranks,
then later tokens) are dropped - their expert output is zero - and counted in `dropped`.
Deterministic, and dropless by default (c = 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_kernels.dispatch import DispatchResult, IdentityCodec, PayloadCodec
from moe_kernels.permute import combine, permute
from moe_kernels.route_map import RouteMap


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse all-to-all (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """x: [sum(in_splits), ...] -> [sum(out_splits), ...]."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable row exchange: x [sum(in_splits), d] -> [sum(out_splits), d]."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class AllToAllContext:
    """What combine needs to send rows back.

    route_map:  this rank's route map (global experts)
    send_splits / recv_splits: host ints per EP rank (rows sent / received in dispatch)
    local_to_recv: [N_recv] int64 local-expert-order row of each received row
    num_kept:   rows computed (N_recv, or the capacity when it binds)
    """

    route_map: RouteMap
    send_splits: list[int]
    recv_splits: list[int]
    local_to_recv: torch.Tensor
    num_recv: int
    num_kept: int


class AllToAllDispatcher:
    """TokenDispatcher for expert parallelism over `group` (ep = group size)."""

    def __init__(self, group: Any, num_experts: int, capacity_factor: float = 0.0, codec: PayloadCodec | None = None):
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if num_experts % self.ep_size != 0:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={self.ep_size}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be >= 0 (0 = dropless)")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.capacity_factor = capacity_factor
        self.codec = codec or IdentityCodec()

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        """x: [T, d] -> rows [N_kept, d] for the local experts, offsets [E_local] int32."""
        if route_map.num_experts != self.num_experts:
            raise ValueError(f"route map has {route_map.num_experts} experts, dispatcher expects {self.num_experts}")
        ep, e_local = self.ep_size, self.num_local_experts
        send_counts = route_map.counts.view(ep, e_local)  # [ep, E_local]: rows for each rank's experts
        recv_counts = torch.empty_like(send_counts)  # [ep, E_local]: from each source rank, per local expert
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        # The one device->host copy: split sizes must be host ints for all_to_all_single.
        host = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = host[:ep], host[ep:]
        num_recv = sum(recv_splits)

        payload = self.codec.encode(permute(x, route_map))  # [T*k, d] in global expert order
        received = self.codec.decode(all_to_all_rows(payload, recv_splits, send_splits, self.group))

        # Received rows come source-rank major; reorder to local-expert major (source rank within).
        local_to_recv = _source_major_to_expert_major(recv_counts, num_recv)
        rows = received.index_select(0, local_to_recv)
        per_expert = recv_counts.sum(0, dtype=torch.int32)
        offsets = torch.cumsum(per_expert, 0, dtype=torch.int32)
        num_kept = num_recv
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        if self.capacity_factor > 0:
            cap = math.ceil(self.capacity_factor * route_map.num_rows)
            if num_recv > cap:
                num_kept = cap
                rows = rows[:cap]
                offsets = offsets.clamp(max=cap)
                dropped = torch.tensor(num_recv - cap, dtype=torch.int64, device=x.device)
        ctx = AllToAllContext(route_map, send_splits, recv_splits, local_to_recv, num_recv, num_kept)
        return DispatchResult(rows, offsets, ctx, dropped)

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        """expert_out: [N_kept, d] local-expert order; weights: [T, k] -> [T, d]."""
        ctx: AllToAllContext = result.context
        if ctx.num_kept < ctx.num_recv:  # dropped rows come back as zeros
            pad = expert_out.new_zeros((ctx.num_recv - ctx.num_kept, *expert_out.shape[1:]))
            expert_out = torch.cat([expert_out, pad])
        recv_order = torch.empty_like(ctx.local_to_recv)
        recv_order.scatter_(0, ctx.local_to_recv, torch.arange(ctx.num_recv, device=recv_order.device))
        back = all_to_all_rows(expert_out.index_select(0, recv_order), ctx.send_splits, ctx.recv_splits, self.group)
        return combine(back, ctx.route_map, weights)


def _source_major_to_expert_major(counts: torch.Tensor, total: int) -> torch.Tensor:
    """counts: [ep, E_local] rows per (source, local expert) -> [total] int64 gather index.

    Received rows are ordered (source, expert); entry i of the result is the received row that
    goes to position i of the (expert, source) order. Built on the device; `total` is a host int.
    """
    ep, e_local = counts.shape
    device = counts.device
    c = counts.to(torch.int64)
    # Start of each (source, expert) block in received order, and in expert-major order.
    recv_start = (torch.cumsum(c.reshape(-1), 0) - c.reshape(-1)).view(ep, e_local)
    ct = c.t().reshape(-1)
    local_start = (torch.cumsum(ct, 0) - ct).view(e_local, ep)
    # For every expert-major row: its (expert, source) block and position inside it.
    block = torch.repeat_interleave(torch.arange(e_local * ep, device=device), ct, output_size=total)
    pos = torch.arange(total, device=device) - local_start.reshape(-1)[block]
    expert, source = block // ep, block % ep
    return recv_start[source, expert] + pos
