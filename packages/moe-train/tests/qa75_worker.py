"""The third party's pieces of test_qa75.py (a transport, a payload codec, a small model) and its spawned ranks
(importable by name, so spawned ranks can unpickle them)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from datetime import timedelta

import test_parallel_harness as h
import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_kernels import AllToAllDispatcher, DispatchResult, LocalDispatcher, RouteMap
from moe_parallel import ParallelLayout, apply_expert_parallel, build_groups
from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer

WORLD = 2
SEQ = 7  # odd: 7 tokens per sequence


def model_config(top_k: int = 2, num_experts: int = 6) -> ModelConfig:
    """Dense layer 1 between MoE layers 0 and 2, a gated shared expert: every kind of linear layer the model has."""
    return ModelConfig(vocab_size=64, d_model=16, num_layers=3, num_heads=2, num_kv_heads=1, dense_hidden=24,
                       dense_layers=[1], num_experts=num_experts, expert_hidden=8, shared_expert_hidden=8,
                       shared_expert_gate=True, router=RouterConfig(top_k=top_k))


class GatherDispatcher:
    """A transport of our own: every expert local; dispatch gathers each expert-sorted row from its token by
    index_select, combine scatters the weighted rows back with index_add. round_rows: the rows are rounded to
    bf16 and back by hand on the way (what a bf16 payload codec does). Records whether it saw an empty expert."""

    def __init__(self, num_experts: int, round_rows: bool = False):
        self.num_local_experts = num_experts
        self.round_rows = round_rows
        self.calls = 0
        self.saw_empty_expert = False

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        self.calls += 1
        self.saw_empty_expert |= bool((route_map.counts == 0).any())
        rows = x.index_select(0, route_map.sort_order // route_map.top_k)
        if self.round_rows:
            rows = rows.to(torch.bfloat16).to(rows.dtype)
        return DispatchResult(rows, route_map.offsets, route_map, torch.zeros((), dtype=torch.int64))

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        rm = result.context
        w = weights.reshape(-1).index_select(0, rm.sort_order).to(expert_out.dtype)
        out = expert_out.new_zeros((rm.num_tokens, expert_out.shape[1]))
        return out.index_add(0, rm.sort_order // rm.top_k, expert_out * w[:, None])


class _GatherRows(torch.autograd.Function):
    """[n, ...] on each rank -> every rank's [n, ...] stacked rank-major; backward: the sum of every rank's gradient
    of my block."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.n = group, t.shape[0]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        me = dist.get_rank(ctx.group)
        return grad[me * ctx.n:(me + 1) * ctx.n], None


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass
class GatherAllContext:
    route_map: RouteMap
    picked: torch.Tensor  # [N_local] int64: the gathered (rank, token, slot) row of each local-expert row
    width: int  # gathered rows per rank: max T * k


class AllGatherDispatcher:
    """An expert-parallel transport of our own over `group`: every rank gathers every rank's token rows and picks the
    ones for its experts (local-expert order, source rank within, as AllToAllDispatcher orders them); combine sums
    every rank's expert outputs over the group and keeps its own rows. Costly, but made of other collectives."""

    def __init__(self, group, num_experts: int):  # noqa: ANN001
        self.group, self.num_experts = group, num_experts
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_local_experts = num_experts // self.ep

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        k, rows = route_map.top_k, route_map.num_rows
        sizes = torch.tensor([rows])
        every = [torch.empty_like(sizes) for _ in range(self.ep)]
        dist.all_gather(every, sizes, group=self.group)
        width = int(torch.cat(every).max())
        sorted_expert = torch.searchsorted(route_map.offsets.long(), torch.arange(rows), right=True)
        expert = torch.full((width,), -1, dtype=torch.int64)
        expert[route_map.sort_order] = sorted_expert  # each (token, slot) row's expert; -1: padding
        flat = F.pad(x.repeat_interleave(k, dim=0), (0, 0, 0, width - rows))
        experts, gathered = _GatherRows.apply(expert, self.group), _GatherRows.apply(flat, self.group)
        lo = self.rank * self.num_local_experts
        mine = (experts >= lo) & (experts < lo + self.num_local_experts)
        order = torch.sort(torch.where(mine, experts, self.num_experts), stable=True).indices
        picked = order[: int(mine.sum())]
        counts = torch.bincount(experts[picked] - lo, minlength=self.num_local_experts)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        ctx = GatherAllContext(route_map, picked, width)
        return DispatchResult(gathered.index_select(0, picked), offsets, ctx, torch.zeros((), dtype=torch.int64))

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        ctx = result.context
        rm, width = ctx.route_map, ctx.width
        every = expert_out.new_zeros((self.ep * width, expert_out.shape[1])).index_copy(0, ctx.picked, expert_out)
        back = _SumOverRanks.apply(every, self.group)[self.rank * width:self.rank * width + rm.num_rows]
        back = back.view(rm.num_tokens, rm.top_k, expert_out.shape[1])
        return (back * weights.to(back.dtype).unsqueeze(-1)).sum(1)


class Bf16Codec:
    """fp32 rows travel as bf16; counts its calls."""

    def __init__(self):
        self.encoded = self.decoded = 0

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        self.encoded += 1
        return rows.to(torch.bfloat16)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        self.decoded += 1
        return payload.to(torch.float32)


def tokens(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def cotangent(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def with_codec(model: Transformer) -> list[Bf16Codec]:
    codecs = []
    for layer in model.moe_layers():
        codecs.append(Bf16Codec())
        layer.dispatcher = LocalDispatcher(layer.num_experts, codec=codecs[-1])
    return codecs


def _pipeline_stages_leave_a_codec_model_alone(rank: int) -> dict:
    """build_groups with pp=2 (one rank per stage), then expert parallelism (ep=1) on a model whose layers carry a
    codec: the dispatchers stay, and a forward / backward gives what the untouched model gives."""
    groups = build_groups(ParallelLayout(dp=1, ep=1, pp=WORLD), num_experts=6)
    torch.manual_seed(0)
    model = Transformer(model_config())
    plain = copy.deepcopy(model)
    codecs = with_codec(model)
    with_codec(plain)
    dispatchers = [layer.dispatcher for layer in model.moe_layers()]
    apply_expert_parallel(model, groups)
    kept = [layer.dispatcher is d for layer, d in zip(model.moe_layers(), dispatchers)]
    x = tokens(2, seed=rank)
    logits, _ = model(x)
    ref, _ = plain(x)
    return {"pp_size": dist.get_world_size(groups.pp), "dp_size": dist.get_world_size(groups.dp),
            "coords": (groups.coords.pp_rank, groups.coords.dp_rank), "dispatchers_kept": kept,
            "calls": [(c.encoded, c.decoded) for c in codecs], "logits_equal": torch.equal(logits, ref)}


def _expert_parallel_carries_the_codec(rank: int) -> dict:
    """ep=2: apply_expert_parallel moves each layer's codec to its all-to-all dispatcher; logits and the local experts'
    gradients equal one process holding every rank's sequences with the codec on a LocalDispatcher."""
    groups = build_groups(ParallelLayout(dp=WORLD, ep=WORLD), num_experts=6)
    torch.manual_seed(1)
    ref_model = Transformer(model_config())
    with_codec(ref_model)
    model = copy.deepcopy(ref_model)
    codecs = [layer.dispatcher.codec for layer in model.moe_layers()]
    apply_expert_parallel(model, groups)
    a2a = [isinstance(layer.dispatcher, AllToAllDispatcher) and layer.dispatcher.codec is c
           for layer, c in zip(model.moe_layers(), codecs)]
    every = [tokens(1 + r, seed=10 + r) for r in range(WORLD)]  # 7 and 14 tokens
    logits, _ = model(every[rank])
    (logits * cotangent(logits.shape, 20 + rank)).sum().backward()

    ref, _ = ref_model(torch.cat(every))
    g = torch.cat([cotangent((1 + r, SEQ, 64), 20 + r) for r in range(WORLD)])
    (ref * g).sum().backward()
    first = sum(1 + r for r in range(rank))
    e_local = 6 // WORLD
    grad_errs = []
    for layer, ref_layer in zip(model.moe_layers(), ref_model.moe_layers()):
        for name in ("w_gate_up", "w_down"):
            got = getattr(layer.experts, name).grad
            want = getattr(ref_layer.experts, name).grad[rank * e_local:(rank + 1) * e_local]
            grad_errs.append((got - want).abs().max().item())
    return {"all_to_all_with_codec": a2a, "calls": [(c.encoded, c.decoded) for c in codecs],
            "logits_err": (logits - ref[first:first + 1 + rank]).abs().max().item(), "grad_errs": grad_errs}


def _a_transport_of_our_own_replaces_the_all_to_all(rank: int) -> dict:
    """ep=2: after apply_expert_parallel (which slices the experts), each layer's dispatcher is replaced by
    AllGatherDispatcher; logits and the local experts' gradients equal one process holding every rank's sequences."""
    groups = build_groups(ParallelLayout(dp=WORLD, ep=WORLD), num_experts=6)
    torch.manual_seed(2)
    ref_model = Transformer(model_config(top_k=3))
    model = copy.deepcopy(ref_model)
    apply_expert_parallel(model, groups)
    for layer in model.moe_layers():
        layer.dispatcher = AllGatherDispatcher(groups.ep, layer.num_experts)
    every = [tokens(2 - r, seed=30 + r) for r in range(WORLD)]  # 14 and 7 tokens
    logits, _ = model(every[rank])
    (logits * cotangent(logits.shape, 40 + rank)).sum().backward()
    ref, _ = ref_model(torch.cat(every))
    (ref * torch.cat([cotangent((2 - r, SEQ, 64), 40 + r) for r in range(WORLD)])).sum().backward()
    first = sum(2 - r for r in range(rank))
    e_local = 6 // WORLD
    grad_errs = [(getattr(layer.experts, name).grad
                  - getattr(ref_layer.experts, name).grad[rank * e_local:(rank + 1) * e_local]).abs().max().item()
                 for layer, ref_layer in zip(model.moe_layers(), ref_model.moe_layers())
                 for name in ("w_gate_up", "w_down")]
    return {"logits_err": (logits - ref[first:first + 2 - rank]).abs().max().item(), "grad_errs": grad_errs}


def run_rank(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)

    def cases(rank: int) -> dict:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
        return {"pp": _pipeline_stages_leave_a_codec_model_alone(rank), "ep": _expert_parallel_carries_the_codec(rank),
                "own_ep_transport": _a_transport_of_our_own_replaces_the_all_to_all(rank)}

    h.run_guarded(rank, cases, out_dir)
