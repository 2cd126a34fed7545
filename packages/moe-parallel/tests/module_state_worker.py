"""Spawned ranks of test_module_state_broadcast.py (importable by name, so child processes can unpickle them).

Every rank builds its model seeded by its own rank, snapshots the frozen parameters, buffers and trainable weights,
calls broadcast_module_state and snapshots them again; the test compares ranks. On 3 ranks: dp=3, the refusals, a
group of one. On 4 ranks: dp=2 pp=2 (two dp groups, each from its own first rank) and dp=4 ep=2 (experts over edp).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from moe_kernels import LocalDispatcher
from moe_parallel import ParallelGroups, ParallelLayout, apply_expert_parallel, broadcast_module_state, build_groups
from outcome import timed_outcome

CHECK_TIMEOUT = timedelta(seconds=8)
E = 4  # experts of ExpertModel


class DenseModel(nn.Module):
    """A trainable layer, a BatchNorm (float statistics, an int64 counter), a frozen embedding, a bool mask, a
    0-element, a 0-dim, a bf16, a non-contiguous buffer, and one meant to differ per rank."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.bn.running_mean.normal_()
        self.bn.running_var.uniform_(0.5, 2.0)
        self.bn.num_batches_tracked.fill_(10 + seed)
        self.emb = nn.Embedding(5, 2).requires_grad_(False)
        self.register_buffer("mask", torch.rand(7) < 0.5)
        self.register_buffer("empty", torch.zeros(0, 3))
        self.register_buffer("scalar", torch.tensor(float(seed)))
        self.register_buffer("low", torch.randn(3).to(torch.bfloat16))
        self.register_buffer("transposed", torch.randn(3, 5).t())
        self.register_buffer("per_rank", torch.full((2,), float(seed)), persistent=False)


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, E))
        self.register_buffer("temperature", torch.rand(1))  # dense: over dp
        self.lb_group = None


class MoELayer(nn.Module):
    """What apply_expert_parallel recognises: num_experts, experts (stacked per expert), dispatcher, router."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.router = Router()
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.randn(E, 3, 3))  # trainable: FlatParams' business
        self.experts.frozen = nn.Parameter(torch.randn(E, 2), requires_grad=False)
        self.experts.register_buffer("usage", torch.randn(E))  # per expert
        self.dispatcher = LocalDispatcher(E)


class ExpertModel(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(3).requires_grad_(False)
        self.norm.weight.data.normal_()
        self.norm.bias.data.normal_()
        self.moe = MoELayer()


def snapshot(model: nn.Module) -> dict:
    return {"state": {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
                      if not t.requires_grad},
            "trainable": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}}


def broadcast(model: nn.Module, groups: ParallelGroups, **kwargs) -> dict:
    before = snapshot(model)
    broadcast_module_state(model, groups, **kwargs)
    return {"before": before, "after": snapshot(model)}


def dense_case(rank: int, layout: ParallelLayout) -> dict:
    groups = build_groups(layout, 1, timeout=CHECK_TIMEOUT)
    return broadcast(DenseModel(seed=rank), groups, exclude=["per_rank"])


def expert_case(rank: int) -> dict:
    groups = build_groups(ParallelLayout(dp=4, ep=2), E, timeout=CHECK_TIMEOUT)
    model = ExpertModel(seed=rank)
    apply_expert_parallel(model, groups)  # each ep rank keeps 2 of the 4 experts' rows
    model.moe.experts.usage = model.moe.experts.usage[2 * groups.coords.ep_rank : 2 * groups.coords.ep_rank + 2]
    return broadcast(model, groups)


def mismatch(rank: int, world: int) -> dict:
    """Rank 2 alone registered its buffer with another shape."""
    groups = build_groups(ParallelLayout(dp=world), 1, timeout=CHECK_TIMEOUT)
    model = DenseModel(seed=rank)
    if rank == 2:
        model.bn.running_var = torch.ones(4)
    return timed_outcome(lambda: broadcast_module_state(model, groups))


def meta_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1 alone forgot to materialize a buffer."""
    groups = build_groups(ParallelLayout(dp=world), 1, timeout=CHECK_TIMEOUT)
    model = DenseModel(seed=rank)
    if rank == 1:
        model.mask = torch.empty(7, dtype=torch.bool, device="meta")
    return timed_outcome(lambda: broadcast_module_state(model, groups))


def group_of_one(rank: int, world: int) -> dict:
    """Every rank alone in its groups (as on a one-process run): nothing changes, no error."""
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    layout = ParallelLayout()
    groups = ParallelGroups(layout, layout.coords(0), alone, alone, alone, alone, alone)
    return broadcast(DenseModel(seed=rank), groups)


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        if world == 3:
            res["dp3"] = dense_case(rank, ParallelLayout(dp=3))
            res["group_of_one"] = group_of_one(rank, world)
            # last: on code where one rank's refusal leaves the others in a collective, they time out (CHECK_TIMEOUT)
            for key, fn in (("mismatch", mismatch), ("meta_on_one_rank", meta_on_one_rank)):
                try:
                    res[key] = fn(rank, world)
                except Exception:  # noqa: BLE001 - the test names it
                    res[key] = {"outcome": traceback.format_exc(), "seconds": -1.0}
                dist.barrier()
        else:
            res["dp2_pp2"] = dense_case(rank, ParallelLayout(dp=2, pp=2))
            res["dp4_ep2"] = expert_case(rank)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
