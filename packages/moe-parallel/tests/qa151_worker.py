"""QA 151's spawned gloo rank (a world of one): the checks a mutation audit (review helper 165) found no test making."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams, GradientSync


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def inf_gradient_skips_the_step() -> dict:
    """An Inf gradient (not only a NaN) makes the norm non-finite: the step is skipped, the weights kept. With
    `not isfinite` narrowed to `isnan`, grad_clip=0 turned the weights to NaN."""
    out = {}
    for clip in (0.0, 1.0):
        net = _net()
        flat = FlatParams(list(net.named_parameters()), dist.group.WORLD, shard=False)
        sync = GradientSync([flat], divisor=1)
        opt = DistributedAdamW([flat], AdamWConfig(lr=1e-2, weight_decay=0.1, grad_clip=clip), world=dist.group.WORLD)
        before = [p.detach().clone() for p in net.parameters()]
        sync.begin_backward(final=True)
        net(torch.randn(4, 8)).pow(2).mean().backward()
        net[0].weight.grad[0, 0] = float("inf")
        sync.finish()
        try:
            result = opt.step()
            out[clip] = {"skipped": bool(result.skipped), "skipped_steps": opt.skipped_steps,
                         "step_count": opt.step_count,
                         "kept": all(torch.equal(p, b) for p, b in zip(net.parameters(), before))}
        except Exception as e:  # noqa: BLE001 - a step that raises is a result the test names
            out[clip] = {"raised": f"{type(e).__name__}: {e}"}
    return out


def buckets_of_exactly_bucket_numel() -> dict:
    """bucket_numel is the most a bucket holds: two 64-element parameters share one 128-element bucket."""
    p, q = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(64))
    flat = FlatParams([("p", p), ("q", q)], dist.group.WORLD, shard=False, bucket_numel=128)
    return {"buckets": len(flat.buckets)}


CHECKS = (inf_gradient_skips_the_step, buckets_of_exactly_bucket_numel)


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        for check in CHECKS:
            res[check.__name__] = check()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
