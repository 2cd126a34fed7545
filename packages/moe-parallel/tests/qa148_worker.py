"""QA 148's spawned gloo ranks: DistributedAdamW.reload_masters after weights loaded from elsewhere."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams, GradientSync

CFG = AdamWConfig(weight_decay=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 143 + 11 + 99 + 9 elements: each rank's shard of the first weight holds some of its elements (a parameter
    # smaller than the 64-element alignment would sit in rank 0's shard alone, leaving rank 1 only padding)
    return nn.Sequential(nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 9))


def _loaded(i: int, p: torch.Tensor) -> torch.Tensor:
    """The weights "loaded from elsewhere": the same on every rank, other than the initial ones."""
    return (torch.arange(p.numel(), dtype=torch.float32).view(p.shape) * 0.01 - 0.1 * (i + 1)).to(p.dtype)


def reload_then_step(rank: int, world: int) -> dict:
    model = _model()
    # small buckets: several per flat, each split over the two ranks
    flat = FlatParams(list(model.named_parameters()), dist.group.WORLD, shard=True, bucket_numel=150)
    sync = GradientSync([flat], divisor=world)
    opt = DistributedAdamW([flat], CFG, world=dist.group.WORLD)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(_loaded(i, p))
    opt.reload_masters()
    opt.refresh_weights()  # the masters written back: the weights must still be the loaded ones
    kept = all(torch.equal(p, _loaded(i, p)) for i, p in enumerate(model.parameters()))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 13, generator=g), torch.randn(8, 9, generator=g)  # the global batch; a half per rank
    sync.begin_backward(final=True)
    nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
    sync.finish()
    opt.step(lr=0.01)
    # the same step by torch's AdamW on one process, from the loaded weights
    ref = _model()
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):
            p.copy_(_loaded(i, p))
    decayed = [p for p in ref.parameters() if p.dim() >= 2]  # DistributedAdamW decays matrices, not vectors
    torch_opt = torch.optim.AdamW([{"params": decayed, "weight_decay": CFG.weight_decay},
                                   {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=0.01, betas=CFG.betas, eps=CFG.eps)
    nn.functional.mse_loss(ref(x), y).backward()
    torch_opt.step()
    gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"kept": kept, "gap": gap}


def run_rank(rank: int, world: int, port: int, out_dir: str, case: str) -> None:
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        res[case] = globals()[case](rank, world)
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
