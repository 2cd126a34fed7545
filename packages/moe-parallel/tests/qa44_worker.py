"""Spawned ranks of test_qa44.py (importable by name, so child processes can unpickle them).

Each check returns plain values (or the error text), so one rank's failure never leaves the others
waiting in a collective; the test file asserts.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel import (
    AdamWConfig,
    DistributedAdamW,
    FlatParams,
    GradientSync,
    ParallelLayout,
    apply_expert_parallel,
    apply_fsdp,
    build_groups,
)


def check_two_flats_on_one_group(rank: int, shard: bool) -> list[list[float]]:
    """Two FlatParams over the same group (say fp32 router weights beside bf16 ones), and a parameter of the
    first one used on rank 0 only: rank 0 completes flat 0's bucket in backward, rank 1 only in finish()."""
    a = nn.Parameter(torch.ones(5))
    b = nn.Parameter(torch.ones(5))
    fa = FlatParams([("a", a)], dist.group.WORLD, shard=shard)
    fb = FlatParams([("b", b)], dist.group.WORLD, shard=shard)  # same size: a mis-pairing goes unnoticed by gloo
    sync = GradientSync([fa, fb], divisor=dist.get_world_size())
    for step in range(2):
        sync.begin_backward(final=True)
        loss = (b * (rank + 1)).sum()
        if rank == 0:  # a's gradient is ready first on rank 0 (its branch was built last)
            loss = loss + (a * 100).sum()
        loss.backward()
        sync.finish()
        out = [fa.grad_buffer[:5].tolist(), fb.grad_buffer[:5].tolist()] if not shard else \
            [fa.buckets[0].grad_shard.tolist(), fb.buckets[0].grad_shard.tolist()]
        sync.zero_grads()
    return out


def check_grad_from_before_flat_params(grad_dtype: torch.dtype) -> list[float]:
    """A bf16 parameter that already holds a .grad (a smoke-test backward) when FlatParams is built."""
    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    (p.float() * 5).sum().backward()
    flat = FlatParams([("p", p)], dist.group.WORLD, shard=False, grad_dtype=grad_dtype)
    sync = GradientSync([flat], divisor=dist.get_world_size())
    sync.begin_backward(final=True)
    p.float().sum().backward()
    sync.finish()
    return flat.grad_buffer[:4].tolist()


class _Experts(nn.Module):
    def __init__(self, e: int):
        super().__init__()
        self.w = nn.Parameter(torch.arange(e * 2, dtype=torch.float32).view(e, 2))


class _Layer(nn.Module):
    def __init__(self, e: int):
        super().__init__()
        self.num_experts = e
        self.experts = _Experts(e)
        self.router = nn.Module()
        self.dispatcher = SimpleNamespace(codec=None)  # a plain object, as moe_kernels' dispatchers are


def check_refused_expert_parallel_changes_nothing(capacity_factor: float, second_layer_experts: int,
                                                  ep: int = 2) -> dict:
    """A later layer that cannot be split (or a bad capacity factor, at ep=1 too, where no dispatcher is built
    to check it) is refused before any layer changes."""
    groups = build_groups(ParallelLayout(dp=2, ep=ep), num_experts=4, timeout=timedelta(seconds=30))
    model = nn.ModuleList([_Layer(4), _Layer(second_layer_experts)])
    dispatcher = model[0].dispatcher
    try:
        apply_expert_parallel(model, groups, capacity_factor=capacity_factor)
        error = "accepted"
    except ValueError as e:
        error = f"ValueError: {e}"
    return {"error": error, "shape": tuple(model[0].experts.w.shape),
            "dispatcher_kept": model[0].dispatcher is dispatcher, "lb_group_set": hasattr(model[0].router, "lb_group")}


def check_optimizer_world_narrower_than_the_gradients() -> str:
    """world=groups.edp (one rank here) for a dense FlatParams reduced over dp (two ranks): each rank's norm
    would miss the other's shard, so the clip factors, or the skip decisions, differ between ranks."""
    groups = build_groups(ParallelLayout(dp=2, ep=2), num_experts=2, timeout=timedelta(seconds=30))
    flat = FlatParams([("w", nn.Parameter(torch.ones(3, 3)))], groups.dp, shard=True)
    try:
        DistributedAdamW([flat], AdamWConfig(), world=groups.edp)
        return "accepted"
    except ValueError as e:
        return f"ValueError: {e}"


class _ExpertLoopBlock(nn.Module):
    """A block whose experts are an nn.ModuleList (a per-expert loop, as many hand-written MoE models are)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(e(x) for e in self.experts)


class _NestedListModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_ExpertLoopBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def check_fsdp_with_nested_module_lists(rank: int, world: int) -> float:
    """apply_fsdp on a model with a ModuleList inside each block: gradients equal the mean of per-rank ones."""
    torch.manual_seed(0)
    model, ref = _NestedListModel(), _NestedListModel()
    ref.load_state_dict(model.state_dict())
    apply_fsdp(model, dist.group.WORLD, "cpu")
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    model(inputs[rank]).square().sum().backward()
    for x in inputs:
        (ref(x).square().sum() / world).backward()
    return max((p.grad.full_tensor() - q.grad).abs().max().item()
               for p, q in zip(model.parameters(), ref.parameters()))


def check_finish_twice(rank: int) -> dict:
    """finish() twice in one step (the second would sum the reduced gradients over the group again), then the
    optimizer step and a next step's finish(); FlatParams built from model.named_parameters() (a generator)."""
    model = nn.Linear(3, 2)
    flat = FlatParams(model.named_parameters(), dist.group.WORLD, shard=False)
    sync = GradientSync([flat], divisor=dist.get_world_size())
    opt = DistributedAdamW([flat], AdamWConfig(lr=0.1), world=dist.group.WORLD)
    out: dict = {}
    for step in range(2):
        sync.begin_backward(final=True)
        model(torch.ones(1, 3) * (rank + 1)).sum().backward()
        sync.finish()
        if step == 0:
            try:
                sync.finish()
                out["second_finish"] = "accepted"
            except RuntimeError as e:
                out["second_finish"] = str(e)
        out[f"grad{step}"] = flat.grad_buffer.tolist()
        opt.step()
        sync.zero_grads()
    return out


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        checks = {f"two_flats_shard={shard}": (check_two_flats_on_one_group, rank, shard) for shard in (True, False)}
        checks["stale_grad_fp32_accumulation"] = (check_grad_from_before_flat_params, torch.float32)
        checks["stale_grad_bf16"] = (check_grad_from_before_flat_params, torch.bfloat16)
        checks["ep_bad_second_layer"] = (check_refused_expert_parallel_changes_nothing, 0.0, 3)
        checks["ep_bad_capacity"] = (check_refused_expert_parallel_changes_nothing, -1.0, 4)
        checks["ep1_bad_capacity"] = (check_refused_expert_parallel_changes_nothing, -1.0, 4, 1)
        checks["narrow_world"] = (check_optimizer_world_narrower_than_the_gradients,)
        checks["fsdp_nested_lists"] = (check_fsdp_with_nested_module_lists, rank, world)
        checks["finish_twice"] = (check_finish_twice, rank)
        for key, (fn, *args) in checks.items():
            try:
                res[key] = fn(*args)
            except Exception:  # noqa: BLE001 - the test names it; the other checks still run
                res[key] = traceback.format_exc()
            dist.barrier()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
