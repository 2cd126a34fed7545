"""Spawned ranks of test_qa136_standalone_user.py (importable by name, so child processes can unpickle them).

A user's own small torch model (no moe_train, no MoE layer) trained on 3 gloo ranks with FlatParams, GradientSync and
DistributedAdamW, plus the misuse checks of QA 136. Each misuse check runs on a group of its own with a short timeout,
so on code where one rank's refusal leaves the others waiting they fail with gloo's timeout instead of hanging.
"""

from __future__ import annotations

import math
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import moe_parallel
from moe_parallel import (
    AdamWConfig,
    DistributedAdamW,
    FlatParams,
    GradientSync,
    ParallelLayout,
    apply_expert_parallel,
    broadcast_module_state,
    build_groups,
)
from outcome import timed_outcome

CFG = AdamWConfig(lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, grad_clip=0.5)
LRS = [0.05, 0.02, 0.0, 0.03, 0.04]  # one per step, changed between steps (0 included: moments still move)
RESUME_LR = 0.01  # one more step after the optimizer state moved from 3 ranks to one
NAN_STEP, NAN_RANK = 3, 2  # a NaN gradient on one rank at this step: skipped on every rank
MICRO = 2
CHECK_TIMEOUT = timedelta(seconds=8)


class UserModel(nn.Module):
    """A model of the user's own: a tied weight used twice, a 0-dim scalar, a 0-element parameter, a branch the
    rank decides on (unused on rank 1), a parameter never used, a frozen one, odd sizes; emb (40 x 4 = 160 elements)
    is cut by the shards of 3 ranks."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(40, 4, generator=g) * 0.3)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.branch = nn.Parameter(torch.randn(4, 4, generator=g) * 0.2)
        self.never = nn.Parameter(torch.randn(3, generator=g))
        # frozen: left out of FlatParams, so not broadcast; the same on every rank (see frozen_after_setup)
        self.frozen = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(7)), requires_grad=False)
        self.head = nn.Parameter(torch.randn(4, 5, generator=g) * 0.3)
        self.bias = nn.Parameter(torch.randn(5, generator=g) * 0.1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(x @ self.emb.t()) @ self.emb  # the tied weight, used twice in one graph
        h = h * self.scale + self.frozen + self.empty.sum()
        if use_branch:
            h = h + h @ self.branch
        return h @ self.head + self.bias


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(3, 4, generator=g), torch.randn(3, 5, generator=g)


def loss_of(model: UserModel, step: int, rank: int, micro: int) -> torch.Tensor:
    x, y = batch(step, rank, micro)
    return ((model(x, use_branch=rank != 1) - y) ** 2).mean() / MICRO


def reference(world: int) -> dict:
    """One process, torch.optim.AdamW on the global batch (decay on matrices only, as DistributedAdamW), torch's
    clip_grad_norm_, the NaN step skipped."""
    model = UserModel(seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": CFG.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, foreach=False,
    )
    norms, before_resume = [], {}
    for step, lr in enumerate([*LRS, RESUME_LR]):
        if step == len(LRS):
            before_resume = {n: p.detach().clone() for n, p in model.named_parameters()}
            counts = _counts(model, opt)
        opt.zero_grad()
        if step == NAN_STEP:  # skipped: no update, no moment, no count
            norms.append(float("nan"))
            continue
        loss = sum(loss_of(model, step, r, m) for r in range(world) for m in range(MICRO)) / world
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], CFG.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return {"weights": before_resume, "resumed": {n: p.detach().clone() for n, p in model.named_parameters()},
            "norms": norms[: len(LRS)], "counts": counts, "resumed_counts": _counts(model, opt)}


def _counts(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    return {n: int(opt.state[p]["step"]) if p in opt.state else 0 for n, p in model.named_parameters()
            if p.requires_grad}


def train(rank: int, world: int) -> dict:
    model = UserModel(seed=rank)  # seeded differently: FlatParams broadcasts rank 0's weights
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flat = FlatParams(named, dist.group.WORLD, shard=True, grad_dtype=torch.float32)
    sync = GradientSync([flat], divisor=world)
    opt = DistributedAdamW([flat], CFG, world=dist.group.WORLD)
    norms, skipped = [], []
    for step, lr in enumerate(LRS):
        for m in range(MICRO):
            sync.begin_backward(final=m == MICRO - 1)
            loss = loss_of(model, step, rank, m)
            if step == NAN_STEP and rank == NAN_RANK and m == 0:
                loss = loss + model.bias.sum() * float("nan")
            loss.backward()
        sync.finish()
        result = opt.step(lr)
        sync.zero_grads()
        norms.append(result.grad_norm)
        skipped.append(result.skipped)
    out = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
           "skipped": skipped, "counts": opt.param_step_counts(), "steps": opt.step_count}
    sync.remove_hooks()
    out["resumed"] = resume_alone(rank, world, opt)
    return out


def resume_alone(rank: int, world: int, opt: DistributedAdamW) -> dict:
    """The README's save / load: owner pieces of 3 ranks assembled by global name and offset, loaded on each rank
    alone (a group of one, other buckets) into a fresh model seeded otherwise, then one step on the global batch."""
    mine = [(p.name, p.key, p.global_shape, p.offset, p.tensor.clone()) for p in opt.state_pieces() if p.owner]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    saved: dict = {}
    for name, key, shape, offset, tensor in (piece for pieces in everyone for piece in pieces):
        flat_state = saved.setdefault((name, key), torch.full((math.prod(shape),), float("nan")))
        flat_state[offset : offset + tensor.numel()] = tensor
    counts, steps = opt.param_step_counts(), opt.step_count
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    model = UserModel(seed=50 + rank)
    flat = FlatParams([(n, p) for n, p in model.named_parameters() if p.requires_grad], alone, shard=True,
                      grad_dtype=torch.float32, bucket_numel=64)
    sync = GradientSync([flat], divisor=1)
    opt2 = DistributedAdamW([flat], CFG, world=alone)
    for p in opt2.state_pieces():
        p.tensor.copy_(saved[p.name, p.key][p.offset : p.offset + p.numel])
    opt2.step_count = steps
    opt2.load_param_step_counts(counts)
    opt2.refresh_weights()
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    pairs = [(r, m) for r in range(world) for m in range(MICRO)]
    for i, (r, m) in enumerate(pairs):  # the global batch, one process
        sync.begin_backward(final=i == len(pairs) - 1)
        (loss_of(model, len(LRS), r, m) / world).backward()
    sync.finish()
    result = opt2.step(RESUME_LR)
    sync.remove_hooks()
    return {"loaded": loaded, "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "counts": opt2.param_step_counts(), "skipped": result.skipped,
            "nan_in_saved": [k for k, t in saved.items() if t.isnan().any()]}


def zero_grad_mid_step(rank: int, world: int) -> dict:
    """model.zero_grad() (torch's set_to_none) between two micro-batches, fp32 weights: the reduced gradient with
    bound .grad views (grad_dtype = the weights' dtype) and with a separate fp32 accumulation buffer (grad_dtype=fp64
    here, the bf16-weights path)."""
    out = {}
    for key, grad_dtype in (("bound", None), ("separate_buffer", torch.float64)):
        p = nn.Parameter(torch.ones(3))
        flat = FlatParams([("p", p)], dist.group.WORLD, shard=False, grad_dtype=grad_dtype)
        sync = GradientSync([flat], divisor=world)
        sync.begin_backward(final=False)
        (p * 1.0).sum().backward()
        p.grad = None  # what model.zero_grad() does
        sync.begin_backward(final=True)
        (p * 2.0).sum().backward()
        sync.finish()
        out[key] = flat.buckets[0].grad_shard[:3].double().tolist()
        sync.remove_hooks()
    return out


def frozen_after_setup(rank: int, world: int) -> dict:
    """The README's recipe on ranks seeded differently: a frozen parameter (left out of FlatParams, as the README says)
    and a buffer. torch DDP broadcasts both from rank 0 at construction (its module-state sync);
    broadcast_module_state does here."""
    torch.manual_seed(100 + rank)
    model = nn.Linear(4, 3)
    model.proj = nn.Parameter(torch.randn(4, 4), requires_grad=False)  # random features, frozen
    model.register_buffer("running", torch.randn(3))
    groups = build_groups(ParallelLayout(dp=world).validate(world, 1), 1, timeout=CHECK_TIMEOUT)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    FlatParams(named, groups.dp, shard=True)
    broadcast_module_state(model, groups)
    gathered = {}
    for name, t in (("weight", model.weight), ("proj", model.proj), ("running", model.running)):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.detach().contiguous())
        gathered[name] = all(torch.equal(parts[0], q) for q in parts[1:])
    return gathered


class OwnMoE(nn.Module):
    """A MoE layer of the user's own, with its own routing: num_experts, stacked experts and a router, no dispatcher."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.randn(num_experts, 4, 4))
        self.router = nn.Linear(4, num_experts)


def ep_without_moe_layer(rank: int, world: int) -> dict:
    """ep = world on a model whose MoE layer apply_expert_parallel does not recognise."""
    groups = build_groups(ParallelLayout(dp=world, ep=world).validate(world, world), world, timeout=CHECK_TIMEOUT)
    model = nn.Sequential(nn.Linear(4, 4), OwnMoE(world))
    out = timed_outcome(lambda: apply_expert_parallel(model, groups))
    out["expert_rows"] = model[1].experts.w.shape[0]
    return out


def meta_everywhere(rank: int) -> dict:
    """Every rank forgot to materialize a model built on the meta device."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=CHECK_TIMEOUT)
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    return timed_outcome(lambda: FlatParams(list(model.named_parameters()), group, shard=True))


def meta_on_one_rank(rank: int) -> dict:
    """Rank 1 alone forgot to materialize its model: every rank must fail at once, the others naming rank 1."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=CHECK_TIMEOUT)
    with torch.device("meta" if rank == 1 else "cpu"):
        model = nn.Linear(4, 3)
    return timed_outcome(lambda: FlatParams(list(model.named_parameters()), group, shard=True))


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {"moe_parallel_file": moe_parallel.__file__}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        res["train"] = train(rank, world)
        res["zero_grad_mid_step"] = zero_grad_mid_step(rank, world)
        res["frozen_after_setup"] = frozen_after_setup(rank, world)
        res["ep_without_moe_layer"] = ep_without_moe_layer(rank, world)
        # last: on code where one rank's refusal leaves the others in a collective, they time out (CHECK_TIMEOUT)
        for key, fn in (("meta_everywhere", meta_everywhere), ("meta_on_one_rank", meta_on_one_rank)):
            try:
                res[key] = fn(rank)
            except Exception:  # noqa: BLE001 - the test names it
                res[key] = {"outcome": traceback.format_exc(), "seconds": -1.0}
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
