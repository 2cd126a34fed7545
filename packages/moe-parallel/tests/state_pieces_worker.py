"""Spawned ranks of test_optimizer_state_pieces.py (importable by name, so child processes can unpickle them), and
the model, data and helpers both sides use (the test computes the one-process reference with the same functions).

One spawn of 4 gloo ranks, fp64: train 2 steps at dp=4 ep=2 with small buckets (shards cut through parameters),
keep every rank's state_pieces(), take a 3rd step straight on; then restore the assembled global state at world 2
(ranks 0 and 1, a second set of groups) twice, dp=2 ep=1 sharded and dp=2 ep=2 unsharded (replicas: owner=False
on one rank), and take the 3rd step there; last, write through the pieces of the 4-rank optimizer and read the
model weights back.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import moe_parallel
from moe_kernels import LocalDispatcher, build_route_map, swiglu_experts
from moe_parallel import (
    AdamWConfig,
    DistributedAdamW,
    FlatParams,
    GradientSync,
    OptimizerStatePiece,
    ParallelGroups,
    ParallelLayout,
    apply_expert_parallel,
    build_groups,
    expert_parameter_names,
)

WORLD = 4
D_IN, D, HIDDEN, NUM_EXPERTS, TOP_K, CLASSES = 7, 10, 6, 4, 2, 5
GLOBAL_TOKENS = 16  # per micro-batch, split over the data-parallel ranks
MICRO_BATCHES = 2
SAVED_AT = 2  # steps before the state is taken; then one more
SEED = 91
ADAMW = AdamWConfig(lr=2e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.3, grad_clip=0.5)
SOURCE = (ParallelLayout(dp=4, ep=2), True, 100)  # layout, shard, bucket_numel: buckets cut through parameters
RESTORES = {  # on ranks 0 and 1
    "dp2_ep1": (ParallelLayout(dp=2, ep=1), True, 1 << 20),
    "dp2_ep2_unsharded": (ParallelLayout(dp=2, ep=2), False, 100),
}


# ---- model and data (the reference uses them too) -------------------------------------------------
class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(NUM_EXPERTS, D, 2 * HIDDEN) / D**0.5)
        self.w_down = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, D) / HIDDEN**0.5)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(NUM_EXPERTS))  # an expert vector: offset = row_offset


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = NUM_EXPERTS
        self.router = nn.Linear(D, NUM_EXPERTS, bias=False)  # apply_expert_parallel sets its lb_group (unused)
        self.experts = Experts()
        self.dispatcher = LocalDispatcher(NUM_EXPERTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, d] -> [T, d]."""
        weights, ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        routed = self.dispatcher.dispatch(x, build_route_map(ids, self.num_experts))
        e = self.experts
        rows = swiglu_experts(routed.rows, e.w_gate_up, e.w_down, routed.offsets, backend="reference")
        ends = routed.offsets.long()
        rows = rows * e.scale.repeat_interleave(torch.diff(ends, prepend=ends.new_zeros(1))).unsqueeze(-1)
        return self.dispatcher.combine(rows, routed, weights)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.late = nn.Linear(D, D)  # no gradient in step 0: its step count lags the others
        self.moe = MoE()
        self.head = nn.Linear(D, CLASSES)

    def loss(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        h = self.inp(x)
        if step > 0:
            h = h + torch.tanh(self.late(h))
        return F.cross_entropy(self.head(h + self.moe(h)), y)


def seeded_model(seed: int = SEED) -> Model:
    torch.manual_seed(seed)
    return Model().double()


def micro_batch(step: int, micro: int, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's rows of the global micro-batch: x [GLOBAL_TOKENS / dp, D_IN] fp64, y [.]."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(GLOBAL_TOKENS, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (GLOBAL_TOKENS,), generator=g)
    rows = slice(dp_rank * GLOBAL_TOKENS // dp, (dp_rank + 1) * GLOBAL_TOKENS // dp)
    return x[rows], y[rows]


def lr_at(step: int) -> float:
    return ADAMW.lr * (step + 1) / (SAVED_AT + 1)


def reference(steps: int) -> list[dict[str, torch.Tensor]]:
    """One process, the global batch, torch.optim.AdamW + clip_grad_norm_ (decay on matrices): weights per step."""
    model = seeded_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": ADAMW.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps)
    out = []
    for step in range(steps):
        for micro in range(MICRO_BATCHES):
            (model.loss(*micro_batch(step, micro), step) / MICRO_BATCHES).backward()
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], ADAMW.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


# ---- checkpointing through state_pieces() (what the README shows) ---------------------------------
def assemble(pieces: Iterable[OptimizerStatePiece]) -> dict[tuple[str, str], torch.Tensor]:
    """(name, key) -> the global tensor, from the owner pieces of every rank (NaN where no piece wrote)."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    for p in pieces:
        if p.owner:
            full = out.setdefault((p.name, p.key), torch.full(p.global_shape, float("nan"), dtype=p.tensor.dtype))
            full.view(-1)[p.offset : p.offset + p.numel] = p.tensor
    return out


def load(opt: DistributedAdamW, saved: dict[tuple[str, str], torch.Tensor], counts: dict[str, int],
         taken: int) -> None:
    """The load sequence: every piece (owner or not), step counts, then the weights from the masters."""
    for p in opt.state_pieces():
        p.tensor.copy_(saved[p.name, p.key].reshape(-1)[p.offset : p.offset + p.numel])
    opt.step_count = taken  # sets every parameter's count: before load_param_step_counts
    opt.load_param_step_counts(counts)
    opt.refresh_weights()


# ---- the distributed side -------------------------------------------------------------------------
def sub_world_groups(layout: ParallelLayout, rank: int) -> ParallelGroups | None:
    """build_groups over ranks [0, layout.world_size) of a bigger world: every rank makes every new_group call, in
    one order (torch's rule); None on the ranks outside."""
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, rank_lists in (("dp", layout.dp_groups()), ("ep", layout.ep_groups()), ("edp", layout.edp_groups()),
                             ("pp", layout.pp_groups()), ("world", [list(range(layout.world_size))])):
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return ParallelGroups(layout, layout.coords(rank), **mine) if rank < layout.world_size else None


def setup(model: Model, groups: ParallelGroups, shard: bool,
          bucket_numel: int) -> tuple[dict, GradientSync, DistributedAdamW]:
    shards = apply_expert_parallel(model, groups)
    experts = expert_parameter_names(model)
    named = list(model.named_parameters())
    flats = [FlatParams([(n, p) for n, p in named if n not in experts], groups.dp, shard, bucket_numel=bucket_numel),
             FlatParams([(n, p) for n, p in named if n in experts], groups.edp, shard, bucket_numel=bucket_numel)]
    sync = GradientSync(flats, divisor=groups.layout.dp)
    return shards, sync, DistributedAdamW(flats, ADAMW, world=groups.world)


def train_step(model: Model, sync: GradientSync, opt: DistributedAdamW, groups: ParallelGroups, step: int) -> float:
    c = groups.coords
    for micro in range(MICRO_BATCHES):
        sync.begin_backward(final=micro == MICRO_BATCHES - 1)
        (model.loss(*micro_batch(step, micro, c.dp_rank, groups.layout.dp), step) / MICRO_BATCHES).backward()
    sync.finish()
    result = opt.step(lr_at(step))
    sync.zero_grads()
    return result.grad_norm


def weights(model: Model, shards: dict) -> dict[str, tuple[torch.Tensor, int]]:
    """name -> (this rank's tensor, its first row in the global tensor)."""
    return {n: (p.detach().clone(), shards[n].row_offset if n in shards else 0) for n, p in model.named_parameters()}


def kept(opt: DistributedAdamW) -> list[OptimizerStatePiece]:
    return [dataclasses.replace(p, tensor=p.tensor.clone()) for p in opt.state_pieces()]


def write_through_pieces(model: Model, shards: dict, opt: DistributedAdamW) -> dict:
    """Masters: each element set to its global flat index; exp_avg: 7. Then refresh_weights()."""
    for p in opt.state_pieces():
        if p.key == "master":
            p.tensor.copy_(torch.arange(p.offset, p.offset + p.numel, dtype=p.tensor.dtype))
        elif p.key == "exp_avg":
            p.tensor.fill_(7.0)
    opt.refresh_weights()
    exp_avg = torch.cat([st.exp_avg for states in opt.states for st in states])
    return {"weights": weights(model, shards), "exp_avg_sum": float(exp_avg.sum()),
            "exp_avg_pieces": sum(p.numel for p in opt.state_pieces() if p.key == "exp_avg")}


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {"moe_parallel_file": moe_parallel.__file__}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        torch.set_num_threads(1)
        layout, shard, bucket_numel = SOURCE
        groups = build_groups(layout, NUM_EXPERTS)
        model = seeded_model()
        shards, sync, opt = setup(model, groups, shard, bucket_numel)
        res["norms"] = [train_step(model, sync, opt, groups, step) for step in range(SAVED_AT)]
        res["weights"] = weights(model, shards)
        res["pieces"] = kept(opt)
        counts, taken = opt.param_step_counts(), opt.step_count
        res["counts"], res["taken"] = counts, taken
        res["straight_norm"] = train_step(model, sync, opt, groups, SAVED_AT)
        res["straight_weights"], res["straight_pieces"] = weights(model, shards), kept(opt)

        everyone: list = [None] * world  # what a checkpoint on disk would hold
        dist.all_gather_object(everyone, res["pieces"])
        saved = assemble(p for pieces in everyone for p in pieces)
        sub_groups = {name: sub_world_groups(layout, rank) for name, (layout, _, _) in RESTORES.items()}
        for name, (_, shard, bucket_numel) in RESTORES.items():
            sub = sub_groups[name]
            if sub is None:
                continue
            resumed = seeded_model(SEED + 1)  # other weights: only what is loaded can make it match
            r_shards, r_sync, r_opt = setup(resumed, sub, shard, bucket_numel)
            load(r_opt, saved, counts, taken)
            got = {"loaded_weights": weights(resumed, r_shards), "loaded_pieces": kept(r_opt),
                   "counts": r_opt.param_step_counts()}
            got["norm"] = train_step(resumed, r_sync, r_opt, sub, SAVED_AT)
            got["weights"], got["pieces"] = weights(resumed, r_shards), kept(r_opt)
            r_sync.remove_hooks()
            res[name] = got
        res["written"] = write_through_pieces(model, shards, opt)
        sync.remove_hooks()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
