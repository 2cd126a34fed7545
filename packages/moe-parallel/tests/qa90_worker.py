"""Spawned ranks of test_qa90.py (importable by name, so child processes can unpickle them), and the model and
data both sides use: the test computes the one-process reference with the same functions.

The model: a dense input projection of odd shape (7 -> 10, 70 elements: no world size divides it), a
1-element gain, a dense block used only in the first micro-batch of some steps (no gradient at all on the
others), a parameter never used, one MoE layer (router over 4 experts of which the last is masked out, so no
token ever chooses it; SwiGLU experts [E, d, 2h] / [E, h, d] and a per-expert scale [E], a vector) and a head.
"""

from __future__ import annotations

import math
import os
import traceback
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
    ParallelLayout,
    apply_expert_parallel,
    build_groups,
    expert_parameter_names,
)
from outcome import timed_outcome as _outcome

WORLD = 4
D_IN, D, HIDDEN, NUM_EXPERTS, TOP_K, CLASSES = 7, 10, 6, 4, 2, 5
TOKENS_PER_RANK = 5  # per micro-batch
MICRO_BATCHES = 2
STEPS = 3  # then one more, once straight on and once after the optimizer state went through a copy
LB_WEIGHT = 0.1
SEED = 90
ADAMW = AdamWConfig(lr=2e-2, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.3, grad_clip=0.3)
BUCKET_NUMEL = 150  # several buckets per FlatParams; shards cut through parameters
# name -> (layout, shard, weights dtype); layout.dp is the whole world (ep folds inside it)
RUNS = {
    "dp4_ep1": (ParallelLayout(dp=4, ep=1), True, torch.float64),
    "dp4_ep2": (ParallelLayout(dp=4, ep=2), True, torch.float64),  # expert-dp groups of 2
    "dp4_ep4": (ParallelLayout(dp=4, ep=4), True, torch.float64),  # one expert per rank, rank 3's never chosen
    "dp4_ep2_allreduce": (ParallelLayout(dp=4, ep=2), False, torch.float64),
    "dp4_ep2_bf16": (ParallelLayout(dp=4, ep=2), True, torch.bfloat16),
}
ROUND_TRIP_RUN = "dp4_ep2"


# ---- model and data (the reference uses them too) -------------------------------------------------
class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(NUM_EXPERTS, D, 2 * HIDDEN) / D**0.5)
        self.w_down = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, D) / HIDDEN**0.5)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(NUM_EXPERTS))  # a vector: no weight decay


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, NUM_EXPERTS, bias=False)
        self.lb_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, d] -> ids [T, k], weights [T, k], balancing loss; the last expert is never chosen."""
        logits = self.proj(x)
        logits = torch.cat([logits[:, :-1], torch.full_like(logits[:, -1:], float("-inf"))], dim=1)
        probs = logits.softmax(-1)
        weights, ids = probs.topk(TOP_K, dim=-1)
        counts = torch.bincount(ids.reshape(-1), minlength=NUM_EXPERTS).to(x.dtype)
        if self.lb_group is not None:
            dist.all_reduce(counts, group=self.lb_group)
        return ids, weights, NUM_EXPERTS * (counts / counts.sum() * probs.mean(0)).sum()


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = NUM_EXPERTS
        self.router = Router()
        self.experts = Experts()
        self.dispatcher = LocalDispatcher(NUM_EXPERTS)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights, balance = self.router(x)
        routed = self.dispatcher.dispatch(x, build_route_map(ids, self.num_experts))
        e = self.experts
        rows = swiglu_experts(routed.rows, e.w_gate_up, e.w_down, routed.offsets, backend="reference")
        ends = routed.offsets.long()
        per_expert = torch.diff(ends, prepend=ends.new_zeros(1))
        rows = rows * e.scale.repeat_interleave(per_expert).unsqueeze(-1)
        return self.dispatcher.combine(rows, routed, weights), balance


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.gain = nn.Parameter(torch.ones(1))
        self.aux = nn.Linear(D, D)
        self.never = nn.Linear(3, 3)
        self.moe = MoE()
        self.head = nn.Linear(D, CLASSES)

    def loss(self, x: torch.Tensor, y: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        h = self.inp(x) * self.gain
        if micro == 0 and step != 1:  # no gradient at all in step 1, nor in later micro-batches
            h = h + torch.tanh(self.aux(h))
        out, balance = self.moe(h)
        wide = torch.promote_types(x.dtype, torch.float32)  # fp64 stays fp64, bf16 losses in fp32
        return F.cross_entropy(self.head(h + out).to(wide), y) + LB_WEIGHT * balance.to(wide)


def seeded_model(dtype: torch.dtype) -> Model:
    torch.manual_seed(SEED)
    return Model().to(dtype)


def micro_batch(step: int, micro: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's x: [TOKENS_PER_RANK, D_IN], y: [TOKENS_PER_RANK] (the reference concatenates the ranks')."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(TOKENS_PER_RANK, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (TOKENS_PER_RANK,), generator=g)
    return x.to(dtype), y


def lr_at(step: int) -> float:
    return ADAMW.lr * (step + 1) / (STEPS + 1)


def param_groups(model: nn.Module) -> list[dict]:
    """As DistributedAdamW decays: matrices (and expert stacks), never vectors."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": ADAMW.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def reference(dtype: torch.dtype, steps: int) -> dict:
    """One process, the concatenated global batch, torch.optim.AdamW + clip_grad_norm_: weights after every step."""
    model = seeded_model(dtype)
    opt = torch.optim.AdamW(param_groups(model), lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps)
    norms, weights, counts = [], [], []
    for step in range(steps):
        for micro in range(MICRO_BATCHES):
            xs, ys = zip(*(micro_batch(step, micro, r, dtype) for r in range(WORLD)))
            (model.loss(torch.cat(xs), torch.cat(ys), step, micro) / MICRO_BATCHES).backward()
        with_grad = [p for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(with_grad, ADAMW.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        counts.append({n: int(opt.state[p]["step"]) if p in opt.state else 0 for n, p in model.named_parameters()})
    return {"norms": norms, "weights": weights, "step_counts": counts, "initial": seeded_model(dtype).state_dict()}


# ---- the distributed side -------------------------------------------------------------------------
def _train_step(model: Model, sync: GradientSync, opt: DistributedAdamW, step: int, rank: int,
                dtype: torch.dtype) -> float:
    for micro in range(MICRO_BATCHES):
        sync.begin_backward(final=micro == MICRO_BATCHES - 1)
        x, y = micro_batch(step, micro, rank, dtype)
        (model.loss(x, y, step, micro) / MICRO_BATCHES).backward()
    sync.finish()
    result = opt.step(lr_at(step))
    sync.zero_grads()
    return result.grad_norm


def _weights(model: Model, shards: dict) -> dict:
    return {n: (p.detach().clone(), shards[n].row_offset if n in shards else None)
            for n, p in model.named_parameters()}


def _masters(opt: DistributedAdamW, shards: dict) -> list[tuple[str, int, torch.Tensor]]:
    """(name, flat offset into the local tensor, master piece) of every element this rank owns: state_pieces()
    places them in the global tensor, so an expert slice's first element comes off."""
    out = []
    for p in opt.state_pieces():
        if p.key == "master" and p.owner:
            start = shards[p.name].row_offset * math.prod(p.global_shape[1:]) if p.name in shards else 0
            out.append((p.name, p.offset - start, p.tensor.clone()))
    return out


def train(rank: int, name: str) -> dict:
    layout, shard, dtype = RUNS[name]
    model = seeded_model(dtype)
    groups = build_groups(layout, NUM_EXPERTS)
    shards = apply_expert_parallel(model, groups)
    experts = expert_parameter_names(model)
    named = list(model.named_parameters())
    grad_dtype = torch.float32 if dtype == torch.bfloat16 else None
    flats = [FlatParams([(n, p) for n, p in named if n not in experts], groups.dp, shard, grad_dtype, BUCKET_NUMEL),
             FlatParams([(n, p) for n, p in named if n in experts], groups.edp, shard, grad_dtype, BUCKET_NUMEL)]
    sync = GradientSync(flats, divisor=layout.dp)
    opt = DistributedAdamW(flats, ADAMW, world=groups.world)
    norms = [_train_step(model, sync, opt, step, rank, dtype) for step in range(STEPS)]
    out = {"norms": norms, "weights": _weights(model, shards), "masters": _masters(opt, shards),
           "step_counts": opt.param_step_counts(), "coords": groups.coords}
    if name == ROUND_TRIP_RUN:
        out["round_trip"] = round_trip(model, sync, opt, flats, groups, rank, dtype, shards)
    sync.remove_hooks()
    return out


def round_trip(model, sync, opt, flats, groups, rank, dtype, shards) -> dict:  # noqa: ANN001
    """Step STEPS straight on, then again from a copy of the state taken before it, loaded into a new optimizer
    (as moe-train's checkpoint does: masters and moments by range, per-parameter counts, refresh_weights)."""
    saved = [[(st.master.clone(), st.exp_avg.clone(), st.exp_avg_sq.clone()) for st in states] for states in opt.states]
    counts, taken = opt.param_step_counts(), opt.step_count
    straight_norm = _train_step(model, sync, opt, STEPS, rank, dtype)
    straight = _weights(model, shards)
    for p in model.parameters():  # the weights a resumed process would hold before loading: anything else
        p.data.add_(1.0)
    loaded = DistributedAdamW(flats, ADAMW, world=groups.world)
    for states, saved_states in zip(loaded.states, saved):
        for st, (master, exp_avg, exp_avg_sq) in zip(states, saved_states):
            st.master.copy_(master)
            st.exp_avg.copy_(exp_avg)
            st.exp_avg_sq.copy_(exp_avg_sq)
    loaded.step_count = taken
    loaded.load_param_step_counts(counts)
    loaded.refresh_weights()
    resumed_norm = _train_step(model, sync, loaded, STEPS, rank, dtype)
    return {"straight": straight, "straight_norm": straight_norm, "resumed": _weights(model, shards),
            "resumed_norm": resumed_norm, "step_counts": loaded.param_step_counts()}


def misuse_experts_over_dp(rank: int) -> dict:
    """dp=4 ep=2: the expert slices given to a FlatParams over groups.dp (ranks holding other experts) instead of
    groups.edp. It was accepted: the broadcast replaced ep rank 1's experts by ep rank 0's, and the reduction summed
    unrelated experts' gradients."""
    model = seeded_model(torch.float64)
    groups = build_groups(ParallelLayout(dp=4, ep=2), NUM_EXPERTS)
    apply_expert_parallel(model, groups)
    experts = expert_parameter_names(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in experts}
    out = _outcome(lambda: FlatParams([(n, p) for n, p in model.named_parameters() if n in experts], groups.dp, True))
    out["experts_kept"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in experts)
    return out


def misuse_reshaped(rank: int) -> dict:
    """A parameter given another shape (same storage) after FlatParams: autograd failed adding the gradient to the
    bound .grad ("The size of tensor a (7) must match ..."), naming no parameter, and zero_grads() failed in a view."""
    model = seeded_model(torch.float64)
    flat = FlatParams(list(model.named_parameters()), dist.group.WORLD, True, bucket_numel=BUCKET_NUMEL)
    sync = GradientSync([flat], divisor=WORLD)
    model.inp.weight.data = model.inp.weight.data.view(D_IN, D)  # (10, 7) -> (7, 10)

    def micro_batch_on_the_new_shape() -> None:
        sync.begin_backward(final=True)
        x, _ = micro_batch(0, 0, rank, torch.float64)
        (x @ model.inp.weight).sum().backward()

    out = {"backward": _outcome(micro_batch_on_the_new_shape), "zero_grads": _outcome(sync.zero_grads)}
    sync.remove_hooks()
    return out


def misuse_uneven_experts(rank: int) -> dict:
    """6 experts over ep=4, in the layout and in apply_expert_parallel (groups built for 4 experts): refused before
    any collective, naming both numbers."""
    torch.manual_seed(SEED)
    model = Model().double()
    model.moe.num_experts = 6
    for p in model.moe.experts.parameters():
        p.data = p.data[:1].expand(6, *p.shape[1:]).clone()
    groups = build_groups(ParallelLayout(dp=4, ep=4), NUM_EXPERTS)
    return {"layout": _outcome(lambda: ParallelLayout(dp=4, ep=4).validate(WORLD, 6)),
            "apply": _outcome(lambda: apply_expert_parallel(model, groups)),
            "experts_kept": model.moe.experts.w_down.shape[0] == 6}


def misuse_expert_parallel_after_flat_params(rank: int) -> dict:
    """apply_expert_parallel (ep=2) after FlatParams took the whole model: it replaced the expert parameters with
    this rank's slices, which no FlatParams holds, while the FlatParams (and the optimizer) kept the old ones: the
    experts silently never trained. Refused before any layer changes."""
    model = seeded_model(torch.float64)
    groups = build_groups(ParallelLayout(dp=4, ep=2), NUM_EXPERTS)
    FlatParams(list(model.named_parameters()), groups.dp, True)
    out = _outcome(lambda: apply_expert_parallel(model, groups))
    out["experts_kept"] = model.moe.experts.w_down.shape[0] == NUM_EXPERTS
    return out


def misuse_layouts_differ(rank: int) -> dict:
    """build_groups given another layout, or another expert count, on the last rank. It made other new_group calls
    there, and every rank waited in them until the store timed out (a DistStoreError naming a key, after
    torch's default 30 minutes). Run last: on that code the ranks' group sequences no longer match afterwards."""
    last = rank == WORLD - 1
    return {
        # rank 3 alone refuses its values (6 experts over ep=4)
        "refused_on_one_rank": _outcome(lambda: build_groups(ParallelLayout(dp=4, ep=4), 6 if last else 8)),
        # both valid, not the same
        "other_layout": _outcome(lambda: build_groups(ParallelLayout(dp=4, ep=4 if last else 2), 8)),
    }


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {"moe_parallel_file": moe_parallel.__file__}
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        # the longest a rank waits in a collective (the code before QA 90 waits this long in each mismatched new_group)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=10))
        for name in RUNS:
            res[name] = train(rank, name)
        for check in (misuse_experts_over_dp, misuse_reshaped, misuse_uneven_experts,
                      misuse_expert_parallel_after_flat_params):
            try:
                res[check.__name__] = check(rank)
            except Exception:  # noqa: BLE001 - the test names it; the other checks still run
                res[check.__name__] = {"outcome": traceback.format_exc(), "seconds": -1.0}
        torch.save(res, path)  # what the test reads if the ranks hang in the next check (they did before QA 90)
        res["misuse_layouts_differ"] = misuse_layouts_differ(rank)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, path)
