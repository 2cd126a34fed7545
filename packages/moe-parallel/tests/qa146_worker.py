"""QA 146's spawned gloo ranks (review helper 150 of moe-parallel 0.12.3): a user MoE model of the test's own, whose
router all-reduces its expert counts over router.lb_group, trained through FlatParams / GradientSync /
DistributedAdamW."""

from __future__ import annotations

import math
import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_kernels import LocalDispatcher, build_route_map, swiglu_experts
from moe_parallel import (AdamWConfig, DistributedAdamW, FlatParams, GradientSync, ParallelLayout,
                          apply_expert_parallel, build_groups)

D_IN, D, H, E, K, CLASSES = 12, 16, 8, 4, 2, 6
TOKENS = 16  # per micro-batch, over every rank (an equal slice each)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(E, D, 2 * H) / math.sqrt(D))
        self.w_down = nn.Parameter(torch.randn(E, H, D) / math.sqrt(H))


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, E, bias=False)
        self.lb_group = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = self.proj(x).softmax(-1)
        weights, ids = probs.topk(K, dim=-1)
        counts = torch.bincount(ids.reshape(-1), minlength=E).float()
        if self.lb_group is not None:  # a collective inside the forward: re-run by a checkpoint's recompute
            dist.all_reduce(counts, group=self.lb_group)
        return ids, weights, E * (counts / counts.sum() * probs.mean(0)).sum()


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.router, self.experts, self.dispatcher = Router(), Experts(), LocalDispatcher(E)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights, balance = self.router(x)
        routed = self.dispatcher.dispatch(x, build_route_map(ids, E))
        rows = swiglu_experts(routed.rows, self.experts.w_gate_up, self.experts.w_down, routed.offsets, "reference")
        return self.dispatcher.combine(rows, routed, weights), balance


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.moe = nn.Linear(D_IN, D), MoELayer()
        self.branch, self.head = nn.Linear(D, D), nn.Linear(D, CLASSES)

    def loss(self, x: torch.Tensor, y: torch.Tensor, use_branch: bool, checkpointed: bool) -> torch.Tensor:
        h = self.inp(x)
        out, balance = checkpoint(self.moe, h, use_reentrant=False) if checkpointed else self.moe(h)
        h = h + out
        if use_branch:
            h = h + self.branch(h)
        return F.cross_entropy(self.head(h), y) + 0.1 * balance


def micro_batch(micro: int, rank: int | None, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal slice of the global micro-batch (rank None: all of it)."""
    g = torch.Generator().manual_seed(100 + micro)
    x = torch.randn(TOKENS, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (TOKENS,), generator=g)
    if rank is None:
        return x, y
    n = TOKENS // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def setup(world: int, overlap: bool = True, bucket_numel: int = 100, timeout: timedelta | None = None,  # noqa: ANN201
          shard: bool = True):
    groups = build_groups(ParallelLayout(dp=world), E, timeout=timeout)
    model = Net()
    apply_expert_parallel(model, groups)
    flat = FlatParams(list(model.named_parameters()), groups.dp, shard=shard, bucket_numel=bucket_numel)
    sync = GradientSync([flat], divisor=world, overlap=overlap)
    opt = DistributedAdamW([flat], AdamWConfig(lr=1e-2), world=groups.world)
    return groups, model, flat, sync, opt


def checkpointed_branch_on_rank0(rank: int, world: int) -> dict:
    """The MoE layer checkpointed (its router's all-reduce re-run during backward) and a Linear used on rank 0 only:
    rank 0 launches the branch's bucket and those after it from the hooks, before the recompute; rank 1 holds them
    until finish(). On one group the two kinds of collectives paired up out of order (gloo: 'Received data size
    doesn't match expected size', the process aborted)."""
    out = {}
    for overlap in (True, False):
        groups, model, flat, sync, opt = setup(world, overlap)
        norms = []
        for _ in range(2):
            sync.begin_backward(final=True)
            model.loss(*micro_batch(0, rank, world), use_branch=rank == 0, checkpointed=True).backward()
            sync.finish()
            norms.append(opt.step().grad_norm)
            sync.zero_grads()
        out[overlap] = {"norms": norms, "weights": flat.param_buffer.clone(),
                        "lb_group_is_dp": model.moe.router.lb_group is groups.dp}
    return out


def replaced_grads(rank: int, world: int) -> dict:
    """fp32 weights (grads bound to the flat buffer): p.grad replaced out of place between two micro-batches, and
    backward(create_graph=True); the buffer's sum against the same sum computed by hand on one process."""
    out = {}
    for case in ("scaled", "create_graph", "scaled_then_unused"):
        groups, model, flat, sync, opt = setup(world, shard=False)  # all-reduced in place: the buffer is the mean
        for micro in range(2):
            sync.begin_backward(final=micro == 1)
            use_branch = micro == 0 or case != "scaled_then_unused"  # then: no gradient reaches the branch again
            loss = model.loss(*micro_batch(micro, rank, world), use_branch=use_branch, checkpointed=False) / 2
            loss.backward(create_graph=case == "create_graph")
            if case.startswith("scaled") and micro == 0:
                model.head.weight.grad = model.head.weight.grad * 0.25
                model.branch.weight.grad = model.branch.weight.grad * 0.25
        sync.finish()
        names = [s.name for s in flat.slots]
        out[case] = {s.name: flat.grad_view(s).clone() for s in flat.slots
                     if s.name in ("head.weight", "inp.weight", "branch.weight")}
        assert "head.weight" in names
        for p in model.parameters():  # create_graph: break the parameter / gradient cycle torch warns about
            p.grad = None
    # by hand, one process, the whole global micro-batch (equal slices: its mean loss is the ranks' mean)
    per_micro = []
    for micro in range(2):
        ref = Net()
        (ref.loss(*micro_batch(micro, None, world), use_branch=True, checkpointed=False) / 2).backward()
        per_micro.append({"head.weight": ref.head.weight.grad, "inp.weight": ref.inp.weight.grad,
                          "branch.weight": ref.branch.weight.grad})
    scale = {"head.weight": 0.25, "branch.weight": 0.25, "inp.weight": 1.0}
    out["want"] = {
        "scaled": {n: scale[n] * per_micro[0][n] + per_micro[1][n] for n in per_micro[0]},
        "create_graph": {n: per_micro[0][n] + per_micro[1][n] for n in per_micro[0]},
        # the branch's scaled gradient alone: the last micro-batch never reached it, so only finish() takes it in
        "scaled_then_unused": {"branch.weight": 0.25 * per_micro[0]["branch.weight"]},
    }
    return out


def unbound_create_graph(rank: int, world: int) -> dict:
    """bf16 weights, fp32 gradients (the hook adds each .grad into the fp32 buffer): backward(create_graph=True) ran
    the add in grad mode, putting the buffer into the graph: unsharded, finish()'s in-place average raised 'a leaf
    Variable that requires grad is being used in an in-place operation' (review helper 153)."""
    groups = build_groups(ParallelLayout(dp=world), E)
    model = Net().to(torch.bfloat16)
    apply_expert_parallel(model, groups)
    flat = FlatParams(list(model.named_parameters()), groups.dp, shard=False, grad_dtype=torch.float32)
    sync = GradientSync([flat], divisor=world)
    for micro in range(2):
        sync.begin_backward(final=micro == 1)
        x, y = micro_batch(micro, rank, world)
        (model.loss(x.bfloat16(), y, use_branch=True, checkpointed=False) / 2).backward(create_graph=True)
    sync.finish()
    return {"buffer_in_graph": flat.grad_buffer.requires_grad or flat.grad_buffer.grad_fn is not None,
            "finite": bool(torch.isfinite(flat.grad_buffer).all()), "nonzero": bool(flat.grad_buffer.abs().sum() > 0)}


def refused_step(rank: int, world: int) -> dict:
    """A non-finite lr, then an AdamWConfig field assigned an invalid value, on rank 1 only: every rank raises, none
    updates; the next valid step runs on the same reduced gradients."""
    groups, model, flat, sync, opt = setup(world)
    sync.begin_backward(final=True)
    model.loss(*micro_batch(0, rank, world), use_branch=True, checkpointed=False).backward()
    sync.finish()
    before = flat.param_buffer.clone()
    out = {}
    for case, lr in (("lr", float("nan") if rank == 1 else 1e-2), ("config", None)):
        if case == "config" and rank == 1:
            opt.cfg.betas = (1.0, 0.95)
        try:
            opt.step(lr)
            out[case] = "accepted"
        except ValueError as err:
            out[case] = str(err)
        opt.cfg.betas = (0.9, 0.95)
    out["unchanged"] = torch.equal(flat.param_buffer, before)
    out["then"] = opt.step(1e-2).skipped
    out["moved"] = not torch.equal(flat.param_buffer, before)
    return out


def late_rank_at_the_step(rank: int, world: int) -> dict:
    """build_groups(timeout=2 s); rank 1 reaches opt.step() 6 s late: rank 0's wait in the global norm's all-reduce
    (groups.world) ends by that timeout, not by init_process_group's (60 s here)."""
    groups, model, flat, sync, opt = setup(world, timeout=timedelta(seconds=2))
    sync.begin_backward(final=True)
    model.loss(*micro_batch(0, rank, world), use_branch=True, checkpointed=False).backward()
    sync.finish()
    if rank == 1:
        time.sleep(6)
    start = time.monotonic()
    try:
        opt.step()
        outcome = "stepped"
    except RuntimeError as err:
        outcome = f"RuntimeError: {str(err)[:200]}"
    return {"outcome": outcome, "waited_s": time.monotonic() - start,
            "world_is_default": groups.world is dist.group.WORLD}


def late_rank_at_build_groups(rank: int, world: int) -> dict:
    """build_groups(timeout=2 s) with rank 1 arriving 6 s late: before moe-parallel 0.13.3 its agreement check ran on
    the default group and rank 0 waited init_process_group's timeout (60 s here)."""
    if rank == 1:
        time.sleep(6)
    start = time.monotonic()
    try:
        build_groups(ParallelLayout(dp=world), E, timeout=timedelta(seconds=2))
        outcome = "built"
    except RuntimeError as err:
        outcome = f"RuntimeError: {str(err)[:200]}"
    return {"outcome": outcome, "waited_s": time.monotonic() - start}


def run_rank(rank: int, world: int, port: int, out_dir: str, case: str) -> None:
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        res[case] = globals()[case](rank, world)
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
