"""Spawned ranks of test_qa141_module_state.py (importable by name, so child processes can unpickle them).

2 ranks (dp=2), each case on its own groups: the defects (an expanded buffer, a conjugate view, exclude=None on one
rank, a non-str name in exclude, an FSDP2-sharded frozen parameter) and what held (registration order, rare dtypes,
1000 buffers, None / non-persistent / aliasing buffers, after FlatParams, twice). 4 ranks: moe-train's Transformer
(dp=4 ep=2 before and after apply_expert_parallel, dp=4 ep=4).
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_parallel import (FlatParams, ParallelLayout, apply_expert_parallel, broadcast_module_state, build_groups)
from outcome import timed_outcome

CHECK_TIMEOUT = timedelta(seconds=8)


def snapshot(model: nn.Module) -> dict:
    """Frozen parameters and buffers (conjugate views resolved), by name."""
    return {n: t.detach().resolve_conj().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
            if not t.requires_grad}


def groups(world: int, layout: ParallelLayout | None = None, num_experts: int = 1):
    return build_groups(layout or ParallelLayout(dp=world), num_experts, timeout=CHECK_TIMEOUT)


def run_case(model: nn.Module, world: int, **kwargs) -> dict:
    before = snapshot(model)
    result = timed_outcome(lambda: broadcast_module_state(model, groups(world), **kwargs))
    return {**result, "before": before, "after": snapshot(model)}


def expanded(rank: int) -> nn.Module:
    m = nn.Module()
    m.register_buffer("pos", (torch.arange(3.0) + rank).expand(4, 3), persistent=False)  # stride 0 on dim 0
    m.register_buffer("after_pos", torch.full((2,), float(rank)))
    return m


def conjugate(rank: int) -> nn.Module:
    m = nn.Module()
    m.register_buffer("c", torch.complex(torch.randn(3), torch.randn(3)).conj())  # a lazy conjugate view
    return m


def rare(rank: int) -> nn.Module:
    m = nn.Module()
    m.register_buffer("f8", torch.randn(5).to(torch.float8_e4m3fn))
    m.register_buffer("c128", torch.randn(3, dtype=torch.complex128))
    m.register_buffer("flags", torch.rand(9) < 0.5)
    m.register_buffer("none", None)
    m.register_buffer("scratch", torch.randn(2), persistent=False)
    m.register_buffer("whole", torch.randn(4))
    m.register_buffer("part", m.whole[1:3])  # a view of another buffer
    return m


def many(rank: int) -> nn.Module:
    m = nn.Module()
    for i in range(1000):
        m.register_buffer(f"b{i}", torch.randn(4))
    return m


def two_ranks(rank: int, world: int) -> dict:
    res: dict = {}
    torch.manual_seed(rank)
    res["expanded"] = run_case(expanded(rank), world)
    res["conjugate"] = run_case(conjugate(rank), world)
    res["rare"] = run_case(rare(rank), world)
    start = time.monotonic()
    res["many"] = run_case(many(rank), world)
    res["many"]["seconds"] = time.monotonic() - start
    m = nn.Module()
    for name in (("a", "b") if rank == 0 else ("b", "a")):
        m.register_buffer(name, torch.randn(2))
    res["order"] = run_case(m, world)
    # after FlatParams: the frozen layer is in none; the trainable one stays bound to the flat buffer; called twice
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2).requires_grad_(False))
    flat = FlatParams([(n, p) for n, p in m.named_parameters() if p.requires_grad], groups(world).dp, shard=False)
    res["after_flat"] = run_case(m, world)
    res["after_flat"]["twice"] = timed_outcome(lambda: broadcast_module_state(m, groups(world)))
    res["after_flat"]["bound"] = all(s.param.data_ptr() == flat.param_view(s).data_ptr() for s in flat.slots)
    res["bad_name"] = run_case(nn.BatchNorm1d(2), world, exclude=["nope", 0])
    # FSDP2: a frozen parameter sharded per rank (last of the accepted-or-refused cases: it imports fsdp)
    from moe_parallel import apply_fsdp
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).requires_grad_(False))
    m.register_buffer("buf", torch.randn(2))
    apply_fsdp(m, groups(world).dp, "cpu")
    local = m[1].weight.to_local().clone()
    res["fsdp"] = timed_outcome(lambda: broadcast_module_state(m, groups(world)))
    res["fsdp"]["local_kept"] = torch.equal(m[1].weight.to_local(), local)
    dist.barrier()
    # last: on code where rank 1 raises alone, rank 0 waits in a collective until it times out (CHECK_TIMEOUT)
    res["exclude_none"] = run_case(nn.BatchNorm1d(2), world, exclude=None if rank == 1 else ())
    return res


def transformer_case(rank: int, layout: ParallelLayout, ep_first: bool) -> dict:
    # moe-train's model: moe-parallel installed alone has none (test_qa141's fixture skips these cases before)
    ModelConfig = pytest.importorskip("moe_train.config").ModelConfig  # noqa: N806
    Transformer = pytest.importorskip("moe_train.model").Transformer  # noqa: N806

    torch.manual_seed(rank)
    cfg = ModelConfig(vocab_size=16, d_model=8, num_layers=2, num_heads=2, num_kv_heads=1, num_experts=4,
                      expert_hidden=4, shared_expert_hidden=4, dense_layers=[0], gemm_backend="torch")
    model = Transformer(cfg)
    moe = model.blocks[1].mlp
    moe.router.expert_bias.normal_()  # per expert, unsliced: one for the whole dp group
    moe.experts.w_down.requires_grad_(False).normal_()
    moe.shared_expert.requires_grad_(False)
    model.embed.requires_grad_(False).weight.normal_()
    g = groups(4, layout, 4)
    before = snapshot(model)
    if ep_first:
        apply_expert_parallel(model, g)
    broadcast_module_state(model, g)
    if not ep_first:
        apply_expert_parallel(model, g)
    return {"before": before, "after": snapshot(model)}


def four_ranks(rank: int, world: int) -> dict:
    return {"ep2_after": transformer_case(rank, ParallelLayout(dp=4, ep=2), ep_first=True),
            "ep2_before": transformer_case(rank, ParallelLayout(dp=4, ep=2), ep_first=False),
            "ep4": transformer_case(rank, ParallelLayout(dp=4, ep=4), ep_first=True)}


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        res = two_ranks(rank, world) if world == 2 else four_ranks(rank, world)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
