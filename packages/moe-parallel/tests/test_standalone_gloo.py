"""moe-parallel on its own: a user's MoE model (torch + moe_kernels only) over 2 gloo processes vs one process.

The model is defined here, not taken from moe_train: a dense Linear, one MoE layer (router with a
global balancing loss over `router.lb_group`, stacked SwiGLU experts behind a token dispatcher),
and a dense head. Both ranks run the README's recipe for dp=2 ep=1 and dp=2 ep=2 (FlatParams
over dp / expert-dp, GradientSync with 2 micro-batches, DistributedAdamW with global-norm
clipping); the reference trains the same seeded model on the whole batch (the same 2 micro-batches,
each both ranks' halves together) with torch.optim.AdamW and clip_grad_norm_.
On one step rank 1 poisons an expert gradient with a NaN: every rank must skip that step, and the
reference skips it too, so the final weights also show that a skip leaves no trace. fp32: losses,
grad norms and final weights within 1e-5 relative.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import traceback
from pathlib import Path

import pytest
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
    ParallelLayout,
    apply_expert_parallel,
    build_groups,
    expert_parameter_names,
)

sys.path.insert(0, str(Path(__file__).parent))
import parallel_spawn  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
LAYOUTS = {"dp2_ep1": ParallelLayout(dp=2, ep=1), "dp2_ep2": ParallelLayout(dp=2, ep=2)}
D_IN, D, HIDDEN, NUM_EXPERTS, TOP_K, CLASSES = 16, 32, 32, 4, 2, 16
LB_WEIGHT = 0.1
GLOBAL_TOKENS = 32  # per micro-batch, over both ranks
MICRO_BATCHES = 2
STEPS = 6
POISONED_STEP = 3  # rank 1 writes a NaN into an expert gradient; every rank must skip this step
SEED = 1234
ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.5)
RTOL = 1e-5
SPAWN_DEADLINE_S = 120  # the whole spawn takes ~15 s on 2 CPU cores


# ---- the user's model ---------------------------------------------------------------------------
class DownProjection(nn.Module):
    def __init__(self, num_experts: int, d: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, hidden, d) / math.sqrt(hidden))


class StackedExperts(nn.Module):
    """w_gate_up: [E, d, 2h] (gate | up); down.weight: [E, h, d] (an expert parameter one module
    deeper: expert parallelism must slice nested expert parameters too)."""

    def __init__(self, num_experts: int, d: int, hidden: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(num_experts, d, 2 * hidden) / math.sqrt(d))
        self.down = DownProjection(num_experts, d, hidden)


class TopKRouter(nn.Module):
    """Softmax top-k with a balancing loss whose expert counts are summed over `lb_group` (set by the parallel code)."""

    def __init__(self, d: int, num_experts: int, top_k: int):
        super().__init__()
        self.proj = nn.Linear(d, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.lb_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, d] -> expert ids [T, k], weights [T, k], balancing loss (scalar)."""
        probs = self.proj(x).softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).float()
        if self.lb_group is not None:
            dist.all_reduce(counts, group=self.lb_group)
        balance = self.num_experts * (counts / counts.sum() * probs.mean(0)).sum()
        return ids, weights, balance


class MoELayer(nn.Module):
    def __init__(self, d: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts = num_experts
        self.router = TopKRouter(d, num_experts, top_k)
        self.experts = StackedExperts(num_experts, d, hidden)
        self.dispatcher = LocalDispatcher(num_experts)  # expert parallelism swaps in the all-to-all one

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, d] -> ([T, d], balancing loss)."""
        ids, weights, balance = self.router(x)
        routed = self.dispatcher.dispatch(x, build_route_map(ids, self.num_experts))
        rows = swiglu_experts(routed.rows, self.experts.w_gate_up, self.experts.down.weight, routed.offsets, backend="reference")
        return self.dispatcher.combine(rows, routed, weights), balance


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.moe = MoELayer(D, HIDDEN, NUM_EXPERTS, TOP_K)
        self.head = nn.Linear(D, CLASSES)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x: [T, D_IN], y: [T] class ids -> mean cross-entropy + weighted balancing loss."""
        h = self.inp(x)
        out, balance = self.moe(h)
        return F.cross_entropy(self.head(h + out), y) + LB_WEIGHT * balance


def seeded_model() -> TinyMoE:
    torch.manual_seed(SEED)
    return TinyMoE()


def global_micro_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [GLOBAL_TOKENS, D_IN], y: [GLOBAL_TOKENS] labels of a fixed random teacher."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    teacher = torch.randn(D_IN, CLASSES, generator=torch.Generator().manual_seed(7))
    x = torch.randn(GLOBAL_TOKENS, D_IN, generator=g)
    return x, (x @ teacher).argmax(-1)


def lr_at(step: int) -> float:
    return ADAMW.lr * min(1.0, (step + 1) / 3)  # a warm-up, so the lr passed to step() matters


# ---- the single-process reference ---------------------------------------------------------------
def train_reference() -> dict:
    model = seeded_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]  # as DistributedAdamW: decay matrices only
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": ADAMW.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps,
    )
    losses, norms = [], []
    for step in range(STEPS):
        loss_sum = 0.0
        for micro in range(MICRO_BATCHES):
            loss = model.loss(*global_micro_batch(step, micro))
            (loss / MICRO_BATCHES).backward()
            loss_sum += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), ADAMW.grad_clip)))
        if step != POISONED_STEP:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.step()
        opt.zero_grad()
        losses.append(loss_sum / MICRO_BATCHES)
    return {"losses": losses, "norms": norms, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ---- the ranks ----------------------------------------------------------------------------------
def local_micro_batch(step: int, micro: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_micro_batch(step, micro)
    rows = slice(dp_rank * GLOBAL_TOKENS // dp, (dp_rank + 1) * GLOBAL_TOKENS // dp)
    return x[rows], y[rows]


def has_non_finite_local_gradient(opt: DistributedAdamW) -> bool:
    """Whether a gradient shard this rank reduced and owns holds a NaN/inf (before the world norm)."""
    return any(not bool(torch.isfinite(b.grad_shard).all()) for f in opt.flats for b in f.buckets)


def train_layout(layout: ParallelLayout) -> dict:
    """The README's recipe on the user's model; returns losses, norms, weights and what the poisoned step did."""
    groups = build_groups(layout.validate(dist.get_world_size(), NUM_EXPERTS), NUM_EXPERTS)
    coords = groups.coords
    model = seeded_model()
    shards = apply_expert_parallel(model, groups)
    experts = expert_parameter_names(model)
    named = list(model.named_parameters())
    flats = [FlatParams([(n, p) for n, p in named if n not in experts], groups.dp, shard=True, grad_dtype=torch.float32),
             FlatParams([(n, p) for n, p in named if n in experts], groups.edp, shard=True, grad_dtype=torch.float32)]
    sync = GradientSync(flats, divisor=layout.dp)
    try:
        DistributedAdamW(flats, ADAMW)  # without world=: a per-rank norm would clip and skip per rank
        missing_world_error = ""
    except ValueError as e:
        missing_world_error = str(e)
    opt = DistributedAdamW(flats, ADAMW, world=groups.world)
    losses, norms, poisoned = [], [], {}
    for step in range(STEPS):
        loss_sum = torch.zeros(())
        for micro in range(MICRO_BATCHES):
            sync.begin_backward(final=micro == MICRO_BATCHES - 1)
            loss = model.loss(*local_micro_batch(step, micro, coords.dp_rank, layout.dp))
            (loss / MICRO_BATCHES).backward()
            loss_sum += loss.detach()
            if step == POISONED_STEP and micro == 0 and coords.rank == 1:
                # Into the accumulation buffer before the final backward: written after it, the NaN would miss
                # the reduce-scatter its hook has already launched.
                model.moe.experts.down.weight.grad.view(-1)[0] = float("nan")
        sync.finish()
        before = [p.detach().clone() for _, p in named]
        non_finite_here = has_non_finite_local_gradient(opt)
        result = opt.step(lr_at(step))
        sync.zero_grads()
        if step == POISONED_STEP:
            poisoned = {"skipped": result.skipped, "grad_norm": result.grad_norm, "non_finite_here": non_finite_here,
                        "unchanged": all(torch.equal(a, p) for a, (_, p) in zip(before, named)),
                        "skipped_steps": opt.skipped_steps}
        dist.all_reduce(loss_sum, group=groups.dp)
        losses.append(float(loss_sum) / (MICRO_BATCHES * layout.dp))
        norms.append(result.grad_norm)
    weights = {n: (shards[n].global_shape, shards[n].row_offset, p.detach().clone()) if n in shards
               else (tuple(p.shape), 0, p.detach().clone()) for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights, "poisoned": poisoned,
            "missing_world_error": missing_world_error, "expert_names": sorted(experts), "shard_names": sorted(shards),
            "step_count": opt.step_count, "state_bytes": opt.state_bytes(),
            "num_params": sum(math.prod(shape) for shape, _, _ in weights.values())}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        res = {key: train_layout(layout) for key, layout in LAYOUTS.items()}
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn_with_deadline(worker, args: tuple) -> None:  # noqa: ANN001
    """Run WORLD ranks; fail instead of hanging when they stop meeting in the same collective
    (ranks that disagree on skipping a step wait for each other for gloo's 30 minutes)."""
    parallel_spawn.spawn_with_deadline(worker, args, WORLD, SPAWN_DEADLINE_S)


def assemble(pieces: list[dict[str, tuple]]) -> dict[str, torch.Tensor]:
    """Per-rank (global shape, row offset, tensor) -> global tensors (NaN where no rank wrote)."""
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in pieces:
        for name, (shape, row_offset, tensor) in rank_pieces.items():
            out.setdefault(name, torch.full(shape, float("nan")))[row_offset : row_offset + tensor.shape[0]] = tensor
    return out


# ---- fixtures and tests -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return train_reference()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("standalone_gloo")
    # Spawned children unpickle the worker by module name: import this file under its plain name.
    sys.path.insert(0, str(Path(__file__).parent))
    worker = importlib.import_module(Path(__file__).stem)._worker
    spawn_with_deadline(worker, (parallel_spawn.free_port(), str(out_dir)))
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("key", LAYOUTS)
def test_losses_and_grad_norms_match_single_process_adamw(reference, ranks, key):
    assert max(reference["norms"]) > ADAMW.grad_clip, "clipping never binds: a wrong global norm would go unseen"
    # The norms are the sharp check of gradient scale: AdamW after clipping is blind to a uniform factor
    # (a missing division by dp leaves the final weights within RTOL and doubles the norm).
    want_losses = torch.tensor(reference["losses"], dtype=torch.float64)
    clean = [s for s in range(STEPS) if s != POISONED_STEP]
    want_norms = torch.tensor(reference["norms"], dtype=torch.float64)[clean]
    for r, res in enumerate(ranks):
        got_losses = torch.tensor(res[key]["losses"], dtype=torch.float64)
        got_norms = torch.tensor(res[key]["norms"], dtype=torch.float64)[clean]
        assert len(got_losses) == STEPS
        loss_err = ((got_losses - want_losses).abs() / want_losses.abs()).max().item()
        assert loss_err < RTOL, f"{key} rank {r}: losses {got_losses.tolist()} vs {want_losses.tolist()}"
        norm_err = ((got_norms - want_norms).abs() / want_norms).max().item()
        assert norm_err < RTOL, f"{key} rank {r}: grad norms {got_norms.tolist()} vs {want_norms.tolist()}"


@pytest.mark.parametrize("key", LAYOUTS)
def test_final_weights_match_single_process_adamw(reference, ranks, key):
    weights = assemble([res[key]["weights"] for res in ranks])
    initial = dict(seeded_model().named_parameters())
    assert set(weights) == set(reference["weights"])
    for name, want in reference["weights"].items():
        got = weights[name]
        assert not torch.isnan(got).any(), f"{key}: {name} not covered by the ranks' expert shards"
        assert not torch.equal(want, initial[name]), f"{name} never trained"
        err = relative_error(got, want)
        assert err < RTOL, f"{key}: {name} differs by {err:.2e} relative to its largest element"


@pytest.mark.parametrize("key", LAYOUTS)
def test_replicas_hold_bit_identical_weights(ranks, key):
    first, second = (res[key]["weights"] for res in ranks)
    for name, (_, row_offset, tensor) in first.items():
        if row_offset == second[name][1]:  # a replicated parameter (not two different expert shards)
            assert torch.equal(tensor, second[name][2]), f"{key}: the replicas of {name} diverged"


@pytest.mark.parametrize("key", LAYOUTS)
def test_optimizer_state_per_rank_is_twelve_bytes_per_parameter_over_dp(ranks, key):
    dp = LAYOUTS[key].dp
    for r, res in enumerate(ranks):
        per_param = res[key]["state_bytes"] * dp / res[key]["num_params"]
        # fp32 master + exp_avg + exp_avg_sq = 12 B per owned element, plus < 10% alignment padding
        assert 12.0 <= per_param < 12.0 * 1.1, f"{key} rank {r}: {per_param:.2f} B/param x dp"


@pytest.mark.parametrize("key", LAYOUTS)
def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(ranks, key):
    poisoned = [res[key]["poisoned"] for res in ranks]
    # Exactly one rank holds the NaN after the reduction; the world norm must stop the other one too.
    assert sum(p["non_finite_here"] for p in poisoned) == 1, poisoned
    for r, (p, res) in enumerate(zip(poisoned, ranks)):
        assert p["skipped"] and not math.isfinite(p["grad_norm"]), f"{key} rank {r}: {p}"
        assert p["unchanged"], f"{key} rank {r}: a skipped step changed the weights"
        assert p["skipped_steps"] == 1 and res[key]["step_count"] == STEPS - 1, f"{key} rank {r}: {p}"
        assert not any(math.isnan(n) for i, n in enumerate(res[key]["norms"]) if i != POISONED_STEP)


@pytest.mark.parametrize("key", LAYOUTS)
def test_optimizer_without_world_group_is_refused_in_a_multi_rank_job(ranks, key):
    for res in ranks:
        assert "DistributedAdamW needs world=" in res[key]["missing_world_error"]


@pytest.mark.parametrize("key", LAYOUTS)
def test_expert_shards_cover_nested_expert_parameters_under_their_model_names(ranks, key):
    for res in ranks:
        assert res[key]["shard_names"] == res[key]["expert_names"] == ["moe.experts.down.weight", "moe.experts.w_gate_up"]
