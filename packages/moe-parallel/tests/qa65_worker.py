"""Spawned ranks of test_qa65.py (importable by name, so child processes can unpickle them)."""

from __future__ import annotations

import gc
import os
import traceback
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel import apply_fsdp


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads: each live gloo group runs a gloo_tcp_loop and pt_gloo_runloops."""
    tasks = Path("/proc/self/task")
    names = [(tasks / t / "comm").read_text().strip() for t in os.listdir(tasks)]
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo")))


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def train_fsdp_then_destroy(rank: int, world: int) -> dict:
    """Two steps of the FSDP2 baseline as DistributedRuntime takes them (its own dp group, torch AdamW, the norm
    clipped), the model and optimizer dropped, then destroy_process_group + gc.collect(): which groups live on."""
    group = dist.new_group(list(range(world)))
    refs = {"dp_group": weakref.ref(group), "world_group": weakref.ref(dist.group.WORLD)}
    torch.manual_seed(0)
    model = apply_fsdp(_Blocks(), group, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    out = {"losses": losses, "threads_with_groups": gloo_threads()}
    del model, opt, group, loss
    dist.destroy_process_group()
    gc.collect()
    out["alive"] = sorted(k for k, r in refs.items() if r() is not None)
    out["threads_after_destroy"] = gloo_threads()
    return out


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        res.update(train_fsdp_then_destroy(rank, world))
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
