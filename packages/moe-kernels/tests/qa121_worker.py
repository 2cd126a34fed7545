"""QA 121's spawned ranks: a two-rank transport written from TokenDispatcher's docs alone, on plain
torch.distributed (`all_to_all_single` through torch.distributed.nn, so autograd runs the reverse exchange), and
AllToAllDispatcher fed a codec whose decoded rows have another width than x."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import kernels_spawn
from moe_kernels import AllToAllDispatcher, DispatchResult, RouteMap, build_route_map, swiglu_experts

D, H = 6, 5


class _Exchange(torch.autograd.Function):
    """all_to_all_single of rows (send_splits out, recv_splits in); backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = rows.new_empty((sum(recv_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        back = grad.new_empty((sum(send_splits), grad.shape[1]))
        dist.all_to_all_single(back, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return back, None, None, None


@dataclass
class A2AContext:
    route_map: RouteMap
    send_splits: list[int]
    recv_splits: list[int]
    to_expert_major: torch.Tensor  # received (source-major) row of each local-expert-major row


class PlainAllToAll:
    """Experts [rank*E_local, (rank+1)*E_local) here; rows travel in global expert order by all_to_all_single."""

    def __init__(self, group, num_experts: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.num_experts, self.e_local = num_experts, num_experts // self.ep

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        rows = x.index_select(0, route_map.sort_order // route_map.top_k)  # global expert order
        counts = route_map.counts.to(torch.int64).reshape(self.ep, self.e_local)
        recv = torch.empty_like(counts)  # row s: what source s sends to my local experts
        dist.all_to_all_single(recv, counts, group=self.group)
        send_splits = counts.sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        arrived = _Exchange.apply(rows, send_splits, recv_splits, self.group)
        # source-major -> local-expert major
        starts = torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)
        order = [torch.arange(int(starts[s * self.e_local + e]), int(starts[s * self.e_local + e] + recv[s, e]))
                 for e in range(self.e_local) for s in range(self.ep)]
        to_em = torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)
        offsets = torch.cumsum(recv.sum(0), 0).to(torch.int32)
        ctx = A2AContext(route_map, send_splits, recv_splits, to_em)
        return DispatchResult(arrived.index_select(0, to_em), offsets, ctx, torch.zeros((), dtype=torch.int64))

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        c = result.context
        src_major = torch.zeros_like(expert_out).index_copy(0, c.to_expert_major, expert_out)
        back = _Exchange.apply(src_major, c.recv_splits, c.send_splits, self.group)
        rm = c.route_map
        w = weights.reshape(-1).index_select(0, rm.sort_order).float()
        out = torch.zeros(rm.num_tokens, back.shape[1], dtype=torch.float32)
        return out.index_add(0, rm.sort_order // rm.top_k, back.float() * w[:, None]).to(expert_out.dtype)


def global_case(seed: int, T: int, E: int, k: int, dtype: torch.dtype, empty: int | None, world: int = 2):
    """Every rank's tokens (T each), router output and the full expert weights, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * T, D, generator=g).to(dtype)
    choices = [e for e in range(E) if e != empty]
    ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=g)[:k]]
                       for _ in range(world * T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    weights = torch.rand(world * T, k, generator=g)
    w1 = (torch.randn(E, D, 2 * H, generator=g) * D**-0.5).to(dtype)
    w2 = (torch.randn(E, H, D, generator=g) * H**-0.5).to(dtype)
    return x, ids, weights, w1, w2


def block(dispatcher, x, ids, weights, w1, w2, num_experts: int):
    result = dispatcher.dispatch(x, build_route_map(ids, num_experts))
    return dispatcher.combine(swiglu_experts(result.rows, w1, w2, result.offsets), result, weights)


def transport_cases(rank: int) -> dict:
    world = dist.get_world_size()
    out = {}
    for name, (T, E, k, dtype, empty) in {
        "odd_T_top1": (7, 4, 1, torch.float32, None), "top_k_E": (5, 4, 4, torch.float32, None),
        "empty_expert": (9, 6, 2, torch.float32, 3), "T0": (0, 4, 2, torch.float32, None),
        "bf16": (7, 4, 2, torch.bfloat16, 1),
    }.items():
        x, ids, weights, w1, w2 = global_case(11, T, E, k, dtype, empty)
        e_local = E // world
        sl = slice(rank * T, (rank + 1) * T)
        xs = x[sl].clone().requires_grad_()
        ws = weights[sl].clone().requires_grad_()
        w1s = w1[rank * e_local:(rank + 1) * e_local].clone().requires_grad_()
        w2s = w2[rank * e_local:(rank + 1) * e_local].clone().requires_grad_()
        y = block(PlainAllToAll(dist.group.WORLD, E), xs, ids[sl], ws, w1s, w2s, E)
        y.float().square().sum().backward()
        out[name] = {"y": y.detach(), "x": xs.grad, "w": ws.grad, "w1": w1s.grad, "w2": w2s.grad}
    return out


class NarrowingCodec:
    def encode(self, rows):
        return rows

    def decode(self, payload):
        return payload[:, :-1]


def narrowing_codec_case(rank: int) -> dict:
    x, ids, weights, w1, w2 = global_case(3, 5, 4, 2, torch.float32, None)
    dispatcher = AllToAllDispatcher(dist.group.WORLD, 4, codec=NarrowingCodec())
    try:
        dispatcher.dispatch(x[rank * 5:(rank + 1) * 5], build_route_map(ids[rank * 5:(rank + 1) * 5], 4))
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


class DetachedRoundingCodec:
    """A wrong straight-through quantiser: the payload requires grad through its learnable scale only, so x would
    get no gradient (moe-kernels <= 0.9.12 took it; review helper 154)."""

    def __init__(self):
        self.scale = torch.full((), 0.125, requires_grad=True)

    def encode(self, rows):
        return (rows / self.scale).round().detach() * self.scale

    def decode(self, payload):
        return payload


def detached_codec_case(rank: int) -> dict:
    x, ids, _, _, _ = global_case(4, 5, 4, 2, torch.float32, None)
    x = x[rank * 5:(rank + 1) * 5].clone().requires_grad_()
    try:
        AllToAllDispatcher(dist.group.WORLD, 4, codec=DetachedRoundingCodec()).dispatch(
            x, build_route_map(ids[rank * 5:(rank + 1) * 5], 4))
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def all_cases(rank: int) -> dict:
    return {"transport": transport_cases(rank), "narrowing": narrowing_codec_case(rank),
            "detached": detached_codec_case(rank)}


def _entry(rank: int, port: int, out_dir: str) -> None:
    kernels_spawn.run_gloo_rank(rank, port, out_dir, 2, 30, all_cases)
