"""Spawned ranks of test_object_lifetime.py (importable by name, so child processes can unpickle them)."""

from __future__ import annotations

import gc
import os
import sys
import traceback
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams, GradientSync


dynamo_was_imported: bool | None = None


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def train_then_drop(rank: int, world: int) -> dict:
    """One step through FlatParams + GradientSync + DistributedAdamW, then drop them without remove_hooks()
    while the model lives on: what stays alive, and whether the model still trains (its hooks find nothing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    flat = FlatParams(model.named_parameters(), dist.group.WORLD, shard=True)
    sync = GradientSync([flat], divisor=world)
    opt = DistributedAdamW([flat], AdamWConfig(lr=0.1), world=dist.group.WORLD)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    sync.begin_backward(final=True)
    F.mse_loss(model(x), torch.zeros(4, 3)).backward()
    sync.finish()
    opt.step(0.1)
    sync.zero_grads()
    refs = {"flat": weakref.ref(flat), "sync": weakref.ref(sync), "optimizer": weakref.ref(opt),
            "grad_buffer": weakref.ref(flat.grad_buffer)}
    del flat, sync, opt
    gc.collect()
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), torch.zeros(4, 3)).backward()  # the hooks outlive what they served: they must do nothing
    return {"alive": sorted(k for k, r in refs.items() if r() is not None),
            "grads_after": {n: p.grad is not None for n, p in model.named_parameters()}}


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    global dynamo_was_imported
    torch.set_num_threads(1)
    dynamo_was_imported = "torch._dynamo" in sys.modules
    res: dict = {"threads_before_init": thread_count()}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        res["threads_with_group"] = thread_count()
        res.update(train_then_drop(rank, world))
        # the first init on the meta device imports torch._dynamo, which imports torch.distributed.nn, whose
        # collectives' default group= is the world group when imported after init_process_group
        torch.nn.init.normal_(torch.empty(3, device="meta"))
        res["dynamo_imported_after_init"] = dynamo_was_imported is False and "torch._dynamo" in sys.modules
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()
        res["threads_after_destroy"] = thread_count()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
