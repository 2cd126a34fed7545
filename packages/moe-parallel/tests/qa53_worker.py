"""Spawned ranks of test_qa53.py (importable by name, so child processes can unpickle them).

Each check returns plain values (or the error text), so one rank's failure never leaves the others
waiting in a collective; the test file asserts.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from moe_kernels import AllToAllDispatcher, LocalDispatcher, build_route_map, swiglu_experts
from moe_parallel import ParallelLayout, apply_expert_parallel, build_groups
from outcome import outcome as _outcome

E, K, D, H = 4, 2, 8, 4
TOKENS = (3, 5, 0, 4)  # rank 2 holds no tokens
TIMEOUT_S = 30


def _inputs() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(53)
    xs = [torch.randn(t, D, generator=g) for t in TOKENS]
    return xs, torch.randn(E, D, generator=g), torch.randn(E, D, 2 * H, generator=g) * D**-0.5, \
        torch.randn(E, H, D, generator=g) * H**-0.5


def _moe(dispatcher, x, router, w1, w2) -> torch.Tensor:  # noqa: ANN001
    probs = (x @ router.t()).softmax(-1)
    weights, ids = probs.topk(K, dim=-1)
    result = dispatcher.dispatch(x, build_route_map(ids, E))
    return dispatcher.combine(swiglu_experts(result.rows, w1, w2, result.offsets), result, weights)


def check_pipeline_stage_groups(rank: int, layout: ParallelLayout) -> dict:
    """build_groups with pp > 1: every group's members, a sum over each, and an EP dispatch + backward inside
    each stage's EP group against one process holding that group's tokens and every expert."""
    groups = build_groups(layout, E, timeout=timedelta(seconds=TIMEOUT_S))
    out: dict = {"coords": groups.coords}
    for kind in ("dp", "ep", "edp", "pp"):
        group = getattr(groups, kind)
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=group)
        out[kind] = (dist.get_process_group_ranks(group), total.item())
    xs, router, w1, w2 = _inputs()
    members = dist.get_process_group_ranks(groups.ep)
    e_local, ep_rank = E // layout.ep, groups.coords.ep_rank
    x = xs[rank].clone().requires_grad_()
    w1_local = w1[ep_rank * e_local:(ep_rank + 1) * e_local].clone().requires_grad_()
    w2_local = w2[ep_rank * e_local:(ep_rank + 1) * e_local].clone().requires_grad_()
    dispatcher = AllToAllDispatcher(groups.ep, E) if layout.ep > 1 else LocalDispatcher(E)
    y = _moe(dispatcher, x, router, w1_local, w2_local)
    y.square().sum().backward()
    # the reference: this EP group's tokens, every expert, one process
    x_ref = torch.cat([xs[r] for r in members]).requires_grad_()
    w1_ref, w2_ref = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    y_ref = _moe(LocalDispatcher(E), x_ref, router, w1_ref, w2_ref)
    y_ref.square().sum().backward()
    lo = sum(TOKENS[r] for r in members[:members.index(rank)])
    rows = slice(lo, lo + TOKENS[rank])
    experts = slice(ep_rank * e_local, (ep_rank + 1) * e_local)
    w1_grad, w2_grad = w1_local.grad.clone(), w2_local.grad.clone()
    if layout.ep == 1:  # each rank computed its own tokens only: sum the group's expert gradients
        dist.all_reduce(w1_grad, group=groups.ep)
        dist.all_reduce(w2_grad, group=groups.ep)
    out["errors"] = [
        (y.detach() - y_ref.detach()[rows]).abs().max().item() if TOKENS[rank] else 0.0,
        (x.grad - x_ref.grad[rows]).abs().max().item() if TOKENS[rank] else 0.0,
        (w1_grad - w1_ref.grad[experts]).abs().max().item(),
        (w2_grad - w2_ref.grad[experts]).abs().max().item(),
    ]
    return out


class _Layer(nn.Module):
    """The minimal MoE layer apply_expert_parallel recognises."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.router = nn.Linear(D, E)
        self.router.lb_group = None
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.zeros(E, D, H))
        self.dispatcher = LocalDispatcher(E)


def check_capacity_factor_refusals(rank: int) -> dict:
    """capacity_factor that is no number: a ValueError naming it, from apply_expert_parallel and from
    AllToAllDispatcher (True was taken as a capacity of 1.0 by the dispatcher; None and "1" raised a bare
    TypeError without the argument's name)."""
    groups = build_groups(ParallelLayout(dp=4, ep=2), E, timeout=timedelta(seconds=TIMEOUT_S))
    out = {}
    for name, value in (("none", None), ("str", "1"), ("bool", True)):
        out[f"apply_{name}"] = _outcome(lambda value=value: apply_expert_parallel(_Layer(), groups, value))
        out[f"dispatcher_{name}"] = _outcome(lambda value=value: AllToAllDispatcher(groups.ep, E, value))
    return out


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    res: dict = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
        for name, layout in (("dp2_ep2_pp2", ParallelLayout(dp=2, ep=2, pp=2)),
                             ("dp2_ep1_pp2", ParallelLayout(dp=2, ep=1, pp=2)),
                             ("dp1_pp4", ParallelLayout(dp=1, ep=1, pp=4))):
            res[name] = check_pipeline_stage_groups(rank, layout)
        for name, layout in (("world_not_a_multiple_of_pp", ParallelLayout(dp=1, ep=1, pp=3)),
                             ("ep_not_dividing_dp", ParallelLayout(dp=4, ep=3))):
            res[name] = _outcome(lambda layout=layout: build_groups(layout, 6))
        res["capacity"] = check_capacity_factor_refusals(rank)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
