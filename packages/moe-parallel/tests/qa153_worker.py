"""QA 153's spawned gloo ranks (a world of two): defects review helper 173 found attacking moe-parallel's public API.
Each check returns plain numbers; the test compares them (references are computed on each rank, from both ranks'
batches, with torch.optim.AdamW and torch.nn.utils.clip_grad_norm_)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams, GradientSync

WORLD = 2
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8


def _net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)


def _grads(net: nn.Module, rank: int, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    dtype = next(net.parameters()).dtype
    x = torch.randn(5, 8, generator=g).to(dtype)
    return list(torch.autograd.grad(net(x).pow(2).mean(), list(net.parameters())))


def _reference(dtype: torch.dtype, steps: int, clip: float) -> list[torch.Tensor]:
    """One process: the mean of both ranks' gradients, clipped as torch clips, then torch's AdamW (no decay)."""
    net = _net(dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    for step in range(steps):
        per_rank = [_grads(net, r, step) for r in range(WORLD)]
        for p, *gs in zip(net.parameters(), *per_rank):
            p.grad = sum(gs) / WORLD
        if clip > 0:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _ours(dtype: torch.dtype, grad_dtype: torch.dtype | None, steps: int, clip: float, *, group: object = "world",
          by_hand: bool = True) -> tuple[list[torch.Tensor], dict]:
    group = dist.group.WORLD if group == "world" else group  # dist.group.WORLD is None until the group exists
    net = _net(dtype)
    flat = FlatParams(list(net.named_parameters()), group, shard=True, grad_dtype=grad_dtype)
    sync = GradientSync([flat], divisor=WORLD)
    opt = DistributedAdamW([flat], AdamWConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, grad_clip=clip),
                           world=dist.group.WORLD)
    rank = dist.get_rank()
    for step in range(steps):
        sync.begin_backward(final=True)
        if by_hand:  # torch.autograd.grad, then .grad assigned: gradient surgery outside autograd's accumulation
            for p, g in zip(net.parameters(), _grads(net, rank, step)):
                p.grad = g
        else:
            g = torch.Generator().manual_seed(1000 * step + rank)
            net(torch.randn(5, 8, generator=g).to(dtype)).pow(2).mean().backward()
        sync.finish()
        opt.step()
        sync.zero_grads()
    return [p.detach().clone() for p in net.parameters()], opt.param_step_counts()


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def a_grad_set_by_hand_is_applied() -> dict:
    """0.13.8: bound, the norm counted the assigned .grad and the update skipped every parameter (step counts 0);
    unbound (another grad_dtype), the .grad never reached the buffer (norm 0, no update)."""
    out = {}
    for name, dtype, grad_dtype in (("fp32 bound", torch.float32, None), ("fp32 into fp64", torch.float32,
                                                                         torch.float64)):
        got, counts = _ours(dtype, grad_dtype, steps=2, clip=0.0)
        out[name] = {"diff": _diff(got, _reference(dtype, 2, 0.0)), "counts": sorted(set(counts.values()))}
    # bf16 weights with fp32 accumulation: the same updates as the same gradients through a backward
    by_hand, counts = _ours(torch.bfloat16, torch.float32, steps=2, clip=0.0)
    backward, _ = _ours(torch.bfloat16, torch.float32, steps=2, clip=0.0, by_hand=False)
    start = [p.detach() for p in _net(torch.bfloat16).parameters()]
    out["bf16 into fp32"] = {"diff": _diff(by_hand, backward), "moved": _diff(by_hand, start),
                             "counts": sorted(set(counts.values()))}
    return out


def finish_without_begin_backward_refuses_an_uncleared_step() -> dict:
    """0.13.8: finish() (no begin_backward, no zero_grads) summed every step's gradients into the next one."""
    net = _net()
    flat = FlatParams(list(net.named_parameters()), dist.group.WORLD, shard=True)
    sync = GradientSync([flat], divisor=WORLD, overlap=False)
    opt = DistributedAdamW([flat], AdamWConfig(lr=LR, weight_decay=0.0, grad_clip=0.0), world=dist.group.WORLD)
    net(torch.randn(5, 8)).pow(2).mean().backward()
    sync.finish()
    first = opt.step().grad_norm
    net(torch.randn(5, 8)).pow(2).mean().backward()
    try:
        sync.finish()
        return {"first_norm": first, "raised": None}
    except RuntimeError as e:
        return {"first_norm": first, "raised": str(e)}


def fp64_weights_clip_as_torch_does() -> dict:
    """0.13.8 divided fp64 gradients by an fp32-rounded 1/coef: 5e-10 off torch's fp64 AdamW when clipping binds."""
    got, _ = _ours(torch.float64, None, steps=3, clip=0.05, by_hand=False)
    unclipped, _ = _ours(torch.float64, None, steps=3, clip=0.0, by_hand=False)
    reference = _reference(torch.float64, 3, 0.05)
    return {"diff": _diff(got, reference), "clip_binds": _diff(unclipped, reference)}


def group_none_is_the_default_group() -> dict:
    """0.13.8: FlatParams(..., group=None) raised torch's 'Group None is not registered'."""
    got, _ = _ours(torch.float32, None, steps=1, clip=0.0, group=None)
    want, _ = _ours(torch.float32, None, steps=1, clip=0.0)
    return {"diff": _diff(got, want)}


def an_explicit_all_to_all_is_installed_at_ep_1() -> dict:
    """Review helper 176: transport=AllToAllDispatcher, named explicitly, was not installed at ep = 1 (the README says
    a transport passed explicitly is), since only another class counted as named."""
    import importlib
    import sys
    from pathlib import Path

    from moe_kernels import AllToAllDispatcher
    from moe_parallel import ParallelLayout, apply_expert_parallel, build_groups

    sys.path.insert(0, str(Path(__file__).parent))
    layers = importlib.import_module("test_expert_parallel_gloo")
    groups = build_groups(ParallelLayout(dp=WORLD, ep=1), layers.E)
    default, named = layers.MoELayer(), layers.MoELayer()
    apply_expert_parallel(default, groups)
    apply_expert_parallel(named, groups, transport=AllToAllDispatcher)
    refused = {}
    for name, factory in (("None", lambda *a, **kw: None), ("no dispatch", lambda *a, **kw: object())):
        model = layers.MoELayer()
        try:
            apply_expert_parallel(model, groups, transport=factory)
            refused[name] = None
        except TypeError as e:
            refused[name] = (str(e), type(model.dispatcher).__name__)
    return {"default": type(default.dispatcher).__name__, "named": type(named.dispatcher).__name__,
            "refused": refused}


CHECKS = (a_grad_set_by_hand_is_applied, finish_without_begin_backward_refuses_an_uncleared_step,
          fp64_weights_clip_as_torch_does, group_none_is_the_default_group, an_explicit_all_to_all_is_installed_at_ep_1)


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        for check in CHECKS:  # one check raising does not hide the others' results
            try:
                res[check.__name__] = check()
            except Exception:  # noqa: BLE001 - the test names it
                res[check.__name__] = {"check raised": traceback.format_exc()}
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
