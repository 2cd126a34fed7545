"""Spawned ranks of test_runtime_qa.py (importable by name, so child processes can unpickle them).

One spawn per world size (3 and 6) runs every check in turn and saves, per rank, a dict of plain
verdicts; the test file computes the single-process references and asserts. Checks that exercise
misuse return the error text (or "accepted") instead of raising, so one rank's verdict never leaves
the others waiting in a collective.

The models:
- `SyntheticMoE`: dense parameters of awkward sizes (1 element, 0 elements, odd shapes, 40 small
  ones, one of 20k) and an MoE layer whose experts are stacked [E, ...] (a matrix, a per-expert
  vector [E, 3] and a per-expert scalar [E]). Its "loss" is sum(p * G) with a fixed G per
  (parameter, step, micro-batch, dp rank), so the gradient each rank produces is known exactly and
  the single-process reference is the mean over ranks and micro-batches (expert rows: over the ranks
  whose EP block holds them, as token rows travel to the expert's rank).
- `RoutedNet`: a real MoE layer (moe_kernels dispatch, SwiGLU experts) whose routing is given by the
  data, so a micro-batch can send no token to some expert from one rank, or none to a whole EP rank.
"""

from __future__ import annotations

import math
import os
import traceback
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_kernels import LocalDispatcher, build_route_map, swiglu_experts
from moe_parallel import (
    AdamWConfig,
    DistributedAdamW,
    FlatParams,
    GradientSync,
    ParallelGroups,
    ParallelLayout,
    apply_expert_parallel,
    build_groups,
    expert_parameter_names,
)

E = 6
CFG = AdamWConfig(lr=3e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3, grad_clip=0.7)
STEPS = 5
NAN_STEP = 3  # the last rank's gradient of `odd` holds a NaN in the first micro-batch: every rank must skip
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
DENSE = {"tiny": (1,), "empty": (0,), "empty2d": (0, 5), "odd": (7, 13), "vec": (3,), "huge": (101, 203),
         "gate": (5, 4), "rank1_only": (3, 3), **{f"small{i}": (i % 5 + 1,) if i % 2 else (i % 3 + 1, i % 4 + 2)
                                                   for i in range(40)}}
EXPERT = {"w": (E, 5, 7), "b": (E, 3), "s": (E,)}
# (key, dp, ep, param dtype, shard, bucket_numel) of the synthetic runs, per world size
SYNTHETIC = {
    3: [("dp3_ep1_fp32_buckets", 3, 1, torch.float32, True, 300),
        ("dp3_ep3_bf16", 3, 3, torch.bfloat16, True, 1 << 25)],
    6: [("dp6_ep2_fp32_allreduce", 6, 2, torch.float32, False, 1000),
        ("dp6_ep3_bf16_buckets", 6, 3, torch.bfloat16, True, 200)],
}
ROUTED = {3: ("routed_dp3_ep3", 3, 3), 6: ("routed_dp6_ep2", 6, 2)}
RELAYOUT = (2, 6, 3, 4, 2)  # steps at dp=6 ep=3, then the optimizer state moves to dp=4 ep=2 (ranks 0-3)


# ---- the synthetic model --------------------------------------------------------------------------
class StackedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        for n, s in EXPERT.items():
            setattr(self, n, nn.Parameter(torch.randn(*s)))


class SyntheticLayer(nn.Module):
    """An MoE layer as apply_expert_parallel sees one (num_experts, experts, dispatcher, router)."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.experts = StackedExperts()
        self.dispatcher = LocalDispatcher(E)
        self.router = nn.Linear(2, E)


class SyntheticMoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for n, s in DENSE.items():
            setattr(self, n, nn.Parameter(torch.randn(*s)))
        self.moe = SyntheticLayer()


def synthetic_grad(name: str, shape: tuple[int, ...], step: int, micro: int, dp_rank: int, last: bool) -> torch.Tensor:
    """The gradient a rank's micro-batch gives `name` (global shape for experts); bf16-exact values.
    last: the last dp rank, whose `odd` gradient holds a NaN at NAN_STEP."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}/{micro}/{dp_rank}".encode()))
    out = (torch.randn(*shape, generator=g) * (3.0 if name == "huge" else 0.5)).to(torch.bfloat16).float()
    if name == "odd" and step == NAN_STEP and micro == 0 and last:
        out.view(-1)[3] = float("nan")
    return out


def synthetic_used(name: str, step: int, dp_rank: int, ep: int) -> bool:
    """Which rank's loss reaches which parameter: `gate` on no rank at odd steps, `rank1_only` on dp rank 1
    only, the expert matrix not on the last EP block's ranks at step 2 (their slice gets no gradient at all)."""
    if name == "gate":
        return step % 2 == 0
    if name == "rank1_only":
        return dp_rank == 1
    if name == "moe.experts.w" and step == 2:
        return dp_rank % ep != ep - 1
    return True


def micro_batches(dtype: torch.dtype) -> int:
    return 3 if dtype == torch.float32 else 2  # bf16 gradients of loss / M are exact only for M a power of two


def synthetic_reference(schedule: list[tuple[int, int]], dtype: torch.dtype) -> dict:
    """One process, torch.optim.AdamW (fp32): schedule[step] = (dp, ep) whose ranks produced that step's gradients."""
    model = SyntheticMoE()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())  # the run's masters start from its (bf16) weights
    opt = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": CFG.weight_decay},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=CFG.lr, betas=CFG.betas, eps=CFG.eps)
    m_count = micro_batches(dtype)
    norms = []
    for step, (dp, ep) in enumerate(schedule):
        nan = False
        for name, p in model.named_parameters():
            g, any_used = torch.zeros_like(p), False
            for r in range(dp):
                if not synthetic_used(name, step, r, ep):
                    continue
                any_used = True
                for m in range(m_count):
                    gr = synthetic_grad(name, tuple(p.shape), step, m, r, r == dp - 1)
                    if name.startswith("moe.experts."):
                        rows = slice(r % ep * (E // ep), (r % ep + 1) * (E // ep))
                        g[rows] += gr[rows]
                    else:
                        g += gr
            p.grad = g / (dp * m_count) if any_used else None
            nan |= any_used and not bool(torch.isfinite(g).all())
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                                          CFG.grad_clip)))
        if not nan:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.step()
        opt.zero_grad(set_to_none=True)
    counts = {n: int(opt.state[p]["step"]) if opt.state[p] else 0 for n, p in model.named_parameters()}
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms, "counts": counts}


def lr_at(step: int) -> float:
    return CFG.lr * (0.5 + 0.25 * step)  # changes every step: the lr passed to step() must be the one used


def build_synthetic(groups: ParallelGroups, dtype: torch.dtype, shard: bool, bucket_numel: int):  # noqa: ANN201
    model = SyntheticMoE()
    shards = apply_expert_parallel(model, groups)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    experts = expert_parameter_names(model)
    named = list(model.named_parameters())
    flats = [FlatParams([(n, p) for n, p in named if n not in experts], groups.dp, shard, torch.float32, bucket_numel),
             FlatParams([(n, p) for n, p in named if n in experts], groups.edp, shard, torch.float32, bucket_numel)]
    return model, shards, flats, GradientSync(flats, divisor=groups.layout.dp), DistributedAdamW(flats, CFG, groups.world)


def train_synthetic(model, shards, sync, opt, groups, steps: range, dtype) -> dict:  # noqa: ANN001
    c, dp, ep = groups.coords, groups.layout.dp, groups.layout.ep
    m_count = micro_batches(dtype)
    norms, skipped, reductions_early = [], [], []
    for step in steps:
        for m in range(m_count):
            before = sync.reductions
            sync.begin_backward(final=m == m_count - 1)
            loss = torch.zeros(())
            for name, p in model.named_parameters():
                if not synthetic_used(name, step, c.dp_rank, ep):
                    continue
                g = synthetic_grad(name, shards[name].global_shape if name in shards else tuple(p.shape), step, m,
                                   c.dp_rank, c.dp_rank == dp - 1)
                if name in shards:
                    g = g[shards[name].row_offset : shards[name].row_offset + p.shape[0]]
                loss = loss + (p.float() * g).sum()
            (loss / m_count).backward()
            if m < m_count - 1:
                reductions_early.append(sync.reductions - before)  # no collective on non-final micro-batches
        sync.finish()
        result = opt.step(lr_at(step))
        sync.zero_grads()
        norms.append(result.grad_norm)
        skipped.append(result.skipped)
    return {"norms": norms, "skipped": skipped, "reductions_early": reductions_early}


def owned_state(opt: DistributedAdamW, shards: dict) -> list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, offset into the flattened global tensor, master, exp_avg, exp_avg_sq) of every piece this rank owns
    (uniquely: an unsharded group's first rank), as a checkpoint writer slices them."""
    out = []
    for flat, states in zip(opt.flats, opt.states):
        if not flat.owns_unique_shard:
            continue
        for bucket, st in zip(flat.buckets, states):
            lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_numel
            for slot in bucket.slots:
                a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
                if a < b:
                    base = shards[slot.name].row_offset * (slot.numel // slot.param.shape[0]) if slot.name in shards else 0
                    out.append((slot.name, base + a - slot.start,
                                *(t[a - lo : b - lo].clone() for t in (st.master, st.exp_avg, st.exp_avg_sq))))
    return out


def weights_of(model: nn.Module, shards: dict) -> dict:
    return {n: (shards[n].row_offset if n in shards else 0, p.detach().clone()) for n, p in model.named_parameters()}


def check_synthetic(key: str, dp: int, ep: int, dtype: torch.dtype, shard: bool, bucket_numel: int) -> dict:
    groups = build_groups(ParallelLayout(dp, ep), E, timeout=COLLECTIVE_TIMEOUT)
    model, shards, flats, sync, opt = build_synthetic(groups, dtype, shard, bucket_numel)
    out = train_synthetic(model, shards, sync, opt, groups, range(STEPS), dtype)
    sync.remove_hooks()
    return {**out, "state": owned_state(opt, shards), "weights": weights_of(model, shards),
            "counts": opt.param_step_counts(), "skipped_steps": opt.skipped_steps, "step_count": opt.step_count}


def sub_layout_groups(layout: ParallelLayout, ranks: int) -> ParallelGroups | None:
    """Groups of `layout` over global ranks [0, ranks) of a larger job (every rank creates every group)."""
    mine = {}
    rank = dist.get_rank()
    for kind, lists in (("dp", layout.dp_groups()), ("ep", layout.ep_groups()), ("edp", layout.edp_groups()),
                        ("pp", layout.pp_groups())):
        for members in lists:
            group = dist.new_group(members, timeout=COLLECTIVE_TIMEOUT)
            if rank in members:
                mine[kind] = group
    if rank >= ranks:
        return None
    return ParallelGroups(layout, layout.coords(rank), mine["dp"], mine["ep"], mine["edp"], mine["pp"], mine["dp"])


def check_relayout() -> dict:
    """Train at dp=6 ep=3, carry the optimizer state by global name and offset (uneven shards: buckets of
    6 x 64-element shards cut through parameters) to dp=4 ep=2 on ranks 0-3, and train on there."""
    steps_a, dp_a, ep_a, dp_b, ep_b = RELAYOUT
    dtype = torch.bfloat16
    groups = build_groups(ParallelLayout(dp_a, ep_a), E, timeout=COLLECTIVE_TIMEOUT)
    model, shards, flats, sync, opt = build_synthetic(groups, dtype, True, 200)
    train_synthetic(model, shards, sync, opt, groups, range(steps_a), dtype)
    sync.remove_hooks()
    pieces: list = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, owned_state(opt, shards))
    counts, step_count = opt.param_step_counts(), opt.step_count
    saved = {}
    for rank_pieces in pieces:
        for name, offset, *tensors in rank_pieces:
            for kind, t in zip(("master", "exp_avg", "exp_avg_sq"), tensors):
                saved.setdefault((name, kind), {})[offset] = t
    global_state = {k: torch.cat([v[o] for o in sorted(v)]) for k, v in saved.items()}

    groups_b = sub_layout_groups(ParallelLayout(dp_b, ep_b), dp_b)
    if groups_b is None:
        return {}
    model, shards, flats, sync, opt = build_synthetic(groups_b, dtype, True, 200)
    with torch.no_grad():  # load: weights from the saved masters (as a checkpoint's weights), then the state
        for name, p in model.named_parameters():
            master = global_state.get((name, "master"))
            if master is not None:
                row = shards[name].row_offset * (p.numel() // p.shape[0]) if name in shards else 0
                p.copy_(master[row : row + p.numel()].view(p.shape))
        for flat, states in zip(opt.flats, opt.states):
            for bucket, st in zip(flat.buckets, states):
                lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_numel
                for slot in bucket.slots:
                    a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
                    if a < b:
                        base = shards[slot.name].row_offset * (slot.numel // slot.param.shape[0]) if slot.name in shards else 0
                        for kind, t in (("master", st.master), ("exp_avg", st.exp_avg), ("exp_avg_sq", st.exp_avg_sq)):
                            t[a - lo : b - lo] = global_state[(slot.name, kind)][base + a - slot.start : base + b - slot.start]
    opt.step_count = step_count
    opt.load_param_step_counts(counts)
    out = train_synthetic(model, shards, sync, opt, groups_b, range(steps_a, STEPS), dtype)
    sync.remove_hooks()
    return {**out, "state": owned_state(opt, shards), "weights": weights_of(model, shards), "counts": opt.param_step_counts()}


# ---- the routed model -----------------------------------------------------------------------------
D_IN, D, H, K, CLASSES, TOKENS = 6, 12, 8, 2, 5, 6  # TOKENS per rank and micro-batch


class GivenRouter(nn.Module):
    """Softmax router whose expert choice comes with the data (ids), so the test decides who gets no tokens."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, E, bias=False)
        self.lb_group = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D], ids: [T, K] -> weights [T, K]."""
        return self.proj(x).softmax(-1).gather(1, ids)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(E, D, 2 * H) / math.sqrt(D))
        self.w_down = nn.Parameter(torch.randn(E, H, D) / math.sqrt(H))


class RoutedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.router = GivenRouter()
        self.experts = Experts()
        self.dispatcher = LocalDispatcher(E)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights = self.router(x, ids)
        routed = self.dispatcher.dispatch(x, build_route_map(ids, E))
        rows = swiglu_experts(routed.rows, self.experts.w_gate_up, self.experts.w_down, routed.offsets, backend="reference")
        return self.dispatcher.combine(rows, routed, weights)


class RoutedNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(D_IN, D)
        self.moe = RoutedLayer()
        self.head = nn.Linear(D, CLASSES)

    def loss(self, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return F.cross_entropy(self.head(h + self.moe(h, ids)), y)


def routed_batch(step: int, micro: int, dp_rank: int, ep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's micro-batch: x [TOKENS, D_IN], ids [TOKENS, K] (distinct experts), y [TOKENS].
    Rank 1 never routes to expert 0; in micro-batch 0, and in all of step 1, no rank routes to the last EP
    block's experts (that EP rank receives no rows: its experts' gradients are zero, or absent)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"routed/{step}/{micro}/{dp_rank}".encode()))
    allowed = torch.ones(E, dtype=torch.bool)
    if dp_rank == 1:
        allowed[0] = False
    if micro == 0 or step == 1:
        allowed[E - E // ep :] = False
    scores = torch.rand(TOKENS, E, generator=g).masked_fill(~allowed, -1.0)
    ids = scores.topk(K, dim=-1).indices
    return torch.randn(TOKENS, D_IN, generator=g), ids, torch.randint(0, CLASSES, (TOKENS,), generator=g)


ROUTED_STEPS, ROUTED_MICRO = 3, 2
ROUTED_CFG = AdamWConfig(lr=3e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3, grad_clip=0.3)  # binds: norms ~0.35


def routed_reference(dp: int, ep: int) -> dict:
    model = RoutedNet()
    opt = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": ROUTED_CFG.weight_decay},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=ROUTED_CFG.lr, betas=ROUTED_CFG.betas, eps=ROUTED_CFG.eps)
    norms = []
    for step in range(ROUTED_STEPS):
        for m in range(ROUTED_MICRO):
            for r in range(dp):  # every rank holds TOKENS tokens: the global mean is the mean of the rank means
                (model.loss(*routed_batch(step, m, r, ep)) / (dp * ROUTED_MICRO)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), ROUTED_CFG.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def check_routed(key: str, dp: int, ep: int) -> dict:
    groups = build_groups(ParallelLayout(dp, ep), E, timeout=COLLECTIVE_TIMEOUT)
    model = RoutedNet()
    shards = apply_expert_parallel(model, groups)
    experts = expert_parameter_names(model)
    named = list(model.named_parameters())
    flats = [FlatParams([(n, p) for n, p in named if n not in experts], groups.dp, True, torch.float32),
             FlatParams([(n, p) for n, p in named if n in experts], groups.edp, True, torch.float32)]
    sync = GradientSync(flats, divisor=dp)
    opt = DistributedAdamW(flats, ROUTED_CFG, world=groups.world)
    norms = []
    for step in range(ROUTED_STEPS):
        for m in range(ROUTED_MICRO):
            sync.begin_backward(final=m == ROUTED_MICRO - 1)
            x, ids, y = routed_batch(step, m, groups.coords.dp_rank, ep)
            (model.loss(x, ids, y) / ROUTED_MICRO).backward()
        sync.finish()
        norms.append(opt.step(lr_at(step)).grad_norm)
        sync.zero_grads()
    sync.remove_hooks()
    return {"norms": norms, "weights": weights_of(model, shards)}


# ---- misuse: each returns the error it raised, or "accepted" ---------------------------------------


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        for key, *args in SYNTHETIC[world]:
            res[key] = check_synthetic(key, *args)
        key, dp, ep = ROUTED[world]
        res[key] = check_routed(key, dp, ep)
        if world == 6:
            res["relayout"] = check_relayout()
        if world == 3:
            from runtime_qa_misuse import MISUSE  # it imports this module's constants

            for fn in MISUSE:
                res[fn.__name__] = fn()
                dist.barrier()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
