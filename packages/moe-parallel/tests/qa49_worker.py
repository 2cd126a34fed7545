"""Spawned ranks of test_qa49.py (importable by name, so child processes can unpickle them).

Each check returns plain values (or the error text), so one rank's failure never leaves the others
waiting in a collective; the test file computes the single-process references and asserts.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import moe_parallel
from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams, GradientSync
from outcome import outcome as _outcome

FP64_CFG = AdamWConfig(lr=2e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.5)
FP64_STEPS, FP64_MICRO = 20, 2


def check_begin_backward_again(rank: int, world: int, shard: bool, second_final: bool) -> dict:
    """begin_backward(final=True), a backward that launches the bucket's reduction, then another micro-batch:
    its gradient would be dropped (reduce-scatter) or the first one summed twice (in-place all-reduce)."""
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    flat = FlatParams([("a", a), ("b", b)], dist.group.WORLD, shard=shard)
    sync = GradientSync([flat], divisor=world)
    sync.begin_backward(final=True)
    ((a + b) * (rank + 1)).sum().backward()  # every parameter arrives: the bucket is launched

    def again() -> None:
        sync.begin_backward(final=second_final)
        ((a + b) * (rank + 1) * 2).sum().backward()

    out = {"again": _outcome(again)}
    sync.finish()  # the refused call changed nothing: the first micro-batch is reduced, once
    grad = flat.buckets[0].grad_shard if shard else flat.grad_buffer
    out["grad"] = sorted(v for v in grad.tolist() if v)
    sync.remove_hooks()
    return out


def check_abandon_with_zero_grads(rank: int, world: int, shard: bool) -> dict:
    """begin_backward(final=True), a backward that launched the reduction, then zero_grads() instead of finish()
    (e.g. the caller skips that step): the next step starts fresh and reduces only its own gradient."""
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    flat = FlatParams([("a", a), ("b", b)], dist.group.WORLD, shard=shard)
    sync = GradientSync([flat], divisor=world)
    sync.begin_backward(final=True)
    ((a + b) * 100.0).sum().backward()
    sync.zero_grads()
    out = {"next": _outcome(lambda: sync.begin_backward(final=True))}
    ((a + b) * (rank + 1)).sum().backward()
    sync.finish()
    grad = flat.buckets[0].grad_shard if shard else flat.grad_buffer
    out["grad"] = sorted(v for v in grad.tolist() if v)
    sync.remove_hooks()
    return out


def check_next_step_without_zero_grads(rank: int, world: int, shard: bool) -> dict:
    """A step, then model.zero_grad() alone (not sync.zero_grads()): `unused` got a gradient in step 1 and none in
    step 2, and its old gradient and "received" flag were still in the flat, so step 2 updated it again."""
    used, unused = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    model = nn.ParameterList([used, unused])
    flat = FlatParams([("used", used), ("unused", unused)], dist.group.WORLD, shard=shard)
    sync = GradientSync([flat], divisor=world)
    opt = DistributedAdamW([flat], AdamWConfig(lr=0.1, weight_decay=0.0, grad_clip=0.0), world=dist.group.WORLD)
    sync.begin_backward(final=True)
    (used + unused).sum().backward()
    sync.finish()
    opt.step()
    model.zero_grad()
    out = {"next_step": _outcome(lambda: sync.begin_backward(final=True))}
    sync.zero_grads()
    out["after_zero_grads"] = _outcome(lambda: sync.begin_backward(final=True))
    sync.remove_hooks()
    return out


def check_config_differs(rank: int) -> str:
    """grad_clip 1.0 on rank 0 and 2.0 on rank 1: each rank clipped by its own factor and the replicas drifted."""
    flat = FlatParams([("w", nn.Parameter(torch.zeros(4)))], dist.group.WORLD, shard=True)
    cfg = AdamWConfig(lr=0.1, grad_clip=1.0 + rank)
    return _outcome(lambda: DistributedAdamW([flat], cfg, world=dist.group.WORLD))


def check_begin_backward_before_step(rank: int, world: int, shard: bool) -> dict:
    """finish(), then another micro-batch's backward before the step: with an unsharded optimizer the reduced
    gradient is the .grad buffer, so the step would use it plus this rank's new, unreduced gradient."""
    w = nn.Parameter(torch.zeros(4))
    flat = FlatParams([("w", w)], dist.group.WORLD, shard=shard)
    sync = GradientSync([flat], divisor=world)
    opt = DistributedAdamW([flat], AdamWConfig(lr=0.1, weight_decay=0.0, grad_clip=0.0), world=dist.group.WORLD)
    sync.begin_backward(final=True)
    (w * (rank + 1)).sum().backward()
    sync.finish()
    out = {"next_micro_batch": _outcome(lambda: sync.begin_backward(final=False))}
    grad = flat.buckets[0].grad_shard if shard else flat.grad_buffer
    out["grad"] = sorted(v for v in grad.tolist() if v)
    opt.step()
    sync.zero_grads()
    out["after_step"] = _outcome(lambda: sync.begin_backward(final=True))
    sync.remove_hooks()
    return out


class Fp64Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(5, 7)
        self.tiny = nn.Parameter(torch.randn(1))
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)) * self.tiny)


def fp64_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def fp64_lr(step: int) -> float:
    return FP64_CFG.lr * (0.5 + 0.1 * (step % 5))


def fp64_reference(world: int) -> dict:
    """One process, torch.optim.AdamW in fp64 over every rank's micro-batches: weights and grad norms."""
    model = Fp64Net().double()
    opt = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": FP64_CFG.weight_decay},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=FP64_CFG.lr, betas=FP64_CFG.betas, eps=FP64_CFG.eps)
    norms = []
    for step in range(FP64_STEPS):
        for m in range(FP64_MICRO):
            for r in range(world):
                x, y = fp64_batch(step, m, r)
                (F.cross_entropy(model(x), y) / (world * FP64_MICRO)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), FP64_CFG.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = fp64_lr(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def check_fp64(rank: int, world: int, shard: bool) -> dict:
    model = Fp64Net().double()
    flat = FlatParams(model.named_parameters(), dist.group.WORLD, shard=shard)
    sync = GradientSync([flat], divisor=world)
    opt = DistributedAdamW([flat], FP64_CFG, world=dist.group.WORLD)
    norms = []
    for step in range(FP64_STEPS):
        for m in range(FP64_MICRO):
            sync.begin_backward(final=m == FP64_MICRO - 1)
            x, y = fp64_batch(step, m, rank)
            (F.cross_entropy(model(x), y) / FP64_MICRO).backward()
        sync.finish()
        norms.append(opt.step(fp64_lr(step)).grad_norm)
        sync.zero_grads()
    sync.remove_hooks()
    owned = sum(b.shard_numel for b in flat.buckets)
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
            "state_bytes_per_element": opt.state_bytes() / owned}


def check_unnamed_parameters() -> dict:
    """model.parameters() instead of model.named_parameters(): a bare tensor unpacks along its first dim."""
    out = {}
    for key, model in (("linear_5x3", nn.Linear(3, 5)), ("linear_2x3", nn.Linear(3, 2))):
        out[key] = _outcome(lambda m=model: FlatParams(m.parameters(), dist.group.WORLD, shard=True))
    out["unnamed_pair"] = _outcome(lambda: FlatParams([(nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2)))],
                                                      dist.group.WORLD, shard=True))
    return out


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    res: dict = {"moe_parallel_file": moe_parallel.__file__}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        # config_differs first: run last, its refusal (an all_gather_object right before destroy_process_group)
        # made one rank abort at exit about one run in three ("terminate called without an active exception")
        checks = {"config_differs": (check_config_differs, rank)}
        for shard in (True, False):
            for second_final in (True, False):
                checks[f"again_shard={shard}_final={second_final}"] = (check_begin_backward_again, rank, world, shard,
                                                                       second_final)
            checks[f"before_step_shard={shard}"] = (check_begin_backward_before_step, rank, world, shard)
            checks[f"abandon_shard={shard}"] = (check_abandon_with_zero_grads, rank, world, shard)
            checks[f"no_zero_grads_shard={shard}"] = (check_next_step_without_zero_grads, rank, world, shard)
            checks[f"fp64_shard={shard}"] = (check_fp64, rank, world, shard)
        checks["unnamed"] = (check_unnamed_parameters,)
        for key, (fn, *args) in checks.items():
            try:
                res[key] = fn(*args)
            except Exception:  # noqa: BLE001 - the test names it; the other checks still run
                res[key] = traceback.format_exc()
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
