"""Parameters that get a gradient on some ranks only, on none, or are frozen; layout values of the wrong type.

Two gloo ranks train a small model whose branches are used by a fixed schedule (per step,
micro-batch and rank): `branch` on rank 0 only in the last micro-batch (its bucket completes
during backward on one rank and not on the other), `early` on rank 1 only in an earlier
micro-batch, `gate` on every rank every other step and on none in between, `late` on no rank
before step 2, `never` on none. Oracles: for the reduced gradients of every step, torch
DistributedDataParallel(find_unused_parameters=True) in the same processes (no_sync on the earlier
micro-batches, the same weights at the start of each step); for the weights after training, one
process with torch.optim.AdamW on the mean of both ranks' losses (a parameter no rank's loss reaches
keeps .grad None and is skipped; the step count is per parameter). Each rank also trains alone over a
group of one against torch.optim.AdamW. fp32: gradients within 1e-6, weights within 1e-5 relative.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_parallel import AdamWConfig, DistributedAdamW, FlatParams, GradientSync, ParallelLayout

pytestmark = pytest.mark.slow

WORLD = 2
SPAWN_DEADLINE_S = 120  # the whole spawn takes ~15 s on 2 CPU cores (as in test_standalone_gloo.py)
D_IN, D, CLASSES, TOKENS = 6, 16, 5, 8  # TOKENS per rank and micro-batch
STEPS, MICRO_BATCHES = 4, 2
ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
# name: (shard, overlap, grad_dtype); float64 gradients of fp32 weights take the hook-accumulation path
CONFIGS = {
    "sharded": (True, True, torch.float32),
    "all_reduce": (False, True, torch.float32),
    "fp64_accumulation": (True, True, torch.float64),
    "no_overlap": (True, False, torch.float32),
}
GRAD_ATOL, WEIGHT_RTOL = 1e-6, 1e-5


class Branchy(nn.Module):
    """A dense model whose branches run only when named in `use`. `never` is registered first, so it
    is the last bucket: it must not hold the others (they follow it in forward order, not in bucket order)."""

    def __init__(self):
        super().__init__()
        self.never = nn.Parameter(torch.randn(5, 7))
        self.inp = nn.Linear(D_IN, D)
        self.early = nn.Parameter(torch.randn(D, 3) / D)
        self.gate = nn.Parameter(torch.randn(D) / 4)
        self.branch = nn.Parameter(torch.randn(D, D) / D)
        self.late = nn.Parameter(torch.randn(D, D + 4) / D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use: frozenset[str]) -> torch.Tensor:
        """x: [T, D_IN], y: [T] -> mean cross-entropy."""
        h = torch.tanh(self.inp(x))
        if "early" in use:
            h = h + (h @ self.early).sum(-1, keepdim=True)
        if "gate" in use:
            h = h * (1 + self.gate)
        if "branch" in use:
            h = h + torch.tanh(h @ self.branch)
        if "late" in use:
            h = h + (h @ self.late)[:, :D]
        return F.cross_entropy(self.head(h), y)


def branches_used(step: int, micro: int, rank: int) -> frozenset[str]:
    final = micro == MICRO_BATCHES - 1
    use = set()
    if final and rank == 0:
        use.add("branch")
    if not final and rank == 1:
        use.add("early")
    if step % 2 == 0:
        use.add("gate")
    if step >= 2 and final and rank == 1:
        use.add("late")
    return frozenset(use)


def seeded_model() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def micro_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(TOKENS, D_IN, generator=g), torch.randint(0, CLASSES, (TOKENS,), generator=g)


def torch_adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # as DistributedAdamW: decay matrices only
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps)


def torch_step(model: nn.Module, opt: torch.optim.AdamW) -> None:
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], ADAMW.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def shard_errors(flat: FlatParams, want: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Max |reduced gradient - want| over the elements of each parameter this rank holds after finish()."""
    errors = {}
    for bucket in flat.buckets:
        lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_numel
        for slot in bucket.slots:
            a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if a < b:
                w = want[slot.name]
                w = torch.zeros(slot.numel) if w is None else w.reshape(-1).double()
                got = bucket.grad_shard[a - lo : b - lo].double()
                errors[slot.name] = max(errors.get(slot.name, 0.0), (got - w[a - slot.start : b - slot.start]).abs().max().item())
    return errors


# ---- the ranks ----------------------------------------------------------------------------------
def train_reference() -> dict[str, torch.Tensor]:
    """One process, torch AdamW: each micro-batch's loss is the mean of both ranks' losses (each with its branches)."""
    model = seeded_model()
    opt = torch_adamw(model)
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            for rank in range(WORLD):
                loss = model(*micro_batch(step, micro, rank), branches_used(step, micro, rank))
                (loss / (WORLD * MICRO_BATCHES)).backward()
        torch_step(model, opt)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_against_ddp(rank: int, shard: bool, overlap: bool, grad_dtype: torch.dtype) -> dict:
    """Ours, with torch DDP computing the reduced gradients of each step from the same weights."""
    ddp_model = seeded_model()
    ddp = nn.parallel.DistributedDataParallel(ddp_model, find_unused_parameters=True)
    model = seeded_model()
    flat = FlatParams(list(model.named_parameters()), dist.group.WORLD, shard=shard, grad_dtype=grad_dtype, bucket_numel=1)
    sync = GradientSync([flat], divisor=WORLD, overlap=overlap)
    opt = DistributedAdamW([flat], ADAMW, world=dist.group.WORLD)
    grad_errors, unreduced_at_finish = [], []
    for step in range(STEPS):
        with torch.no_grad():
            for p_ddp, p in zip(ddp_model.parameters(), model.parameters()):
                p_ddp.copy_(p)
        reductions_before = sync.reductions
        for micro in range(MICRO_BATCHES):
            x, y, use = *micro_batch(step, micro, rank), branches_used(step, micro, rank)
            final = micro == MICRO_BATCHES - 1
            if final:
                (ddp(x, y, use) / MICRO_BATCHES).backward()
            else:
                with ddp.no_sync():
                    (ddp(x, y, use) / MICRO_BATCHES).backward()
            sync.begin_backward(final)
            (model(x, y, use) / MICRO_BATCHES).backward()
        unreduced_at_finish.append(len(flat.buckets) - (sync.reductions - reductions_before))
        sync.finish()
        grad_errors.append(shard_errors(flat, {n: p.grad for n, p in ddp_model.named_parameters()}))
        ddp_model.zero_grad(set_to_none=True)
        opt.step()
        sync.zero_grads()
    return {"grad_errors": grad_errors, "unreduced_at_finish": unreduced_at_finish,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def launches_during_backward_when_every_parameter_is_used() -> tuple[int, int]:
    """(buckets reduced before finish(), buckets) for a final backward that reaches every parameter."""
    model = seeded_model()
    named = [(n, p) for n, p in model.named_parameters() if n != "never"]
    flat = FlatParams(named, dist.group.WORLD, shard=True, grad_dtype=torch.float32, bucket_numel=1)
    sync = GradientSync([flat], divisor=WORLD)
    sync.begin_backward(final=True)
    model(*micro_batch(0, 0, dist.get_rank()), frozenset({"early", "gate", "branch", "late"})).backward()
    launched = sync.reductions
    sync.finish()
    return launched, len(flat.buckets)


def train_alone(group: dist.ProcessGroup) -> dict:
    """World size one (a group of one: no collective) against torch.optim.AdamW in this process."""
    ref, model = seeded_model(), seeded_model()
    ref_opt = torch_adamw(ref)
    flat = FlatParams(list(model.named_parameters()), group, shard=True, grad_dtype=torch.float32)
    sync = GradientSync([flat], divisor=1)
    opt = DistributedAdamW([flat], ADAMW, world=group)
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            x, y, use = *micro_batch(step, micro, 0), branches_used(step, micro, step % 2)
            (ref(x, y, use) / MICRO_BATCHES).backward()
            sync.begin_backward(micro == MICRO_BATCHES - 1)
            (model(x, y, use) / MICRO_BATCHES).backward()
        sync.finish()
        torch_step(ref, ref_opt)
        opt.step()
        sync.zero_grads()
    ref_steps = {n: int(ref_opt.state[p]["step"]) if ref_opt.state[p] else 0 for n, p in ref.named_parameters()}
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "ref_weights": {n: p.detach().clone() for n, p in ref.named_parameters()},
            "step_counts": opt.param_step_counts(), "ref_step_counts": ref_steps,
            "reloaded": step_counts_reloaded(group, opt.param_step_counts())}


def step_counts_reloaded(group: dist.ProcessGroup, counts: dict[str, int]) -> dict:
    """A fresh optimizer given `counts` (as from a checkpoint): what it then reports, and what it refuses."""
    flat = FlatParams(list(seeded_model().named_parameters()), group, shard=True, grad_dtype=torch.float32)
    opt = DistributedAdamW([flat], ADAMW, world=group)
    opt.step_count = 9  # as a checkpoint's optim.step is set first; the per-parameter counts then win
    opt.load_param_step_counts(counts)
    out = {"counts": opt.param_step_counts(), "step_count": opt.step_count, "errors": []}
    for bad in ({k: v for k, v in counts.items() if k != "gate"}, {**counts, "gone": 1}, {**counts, "gate": -1}):
        try:
            opt.load_param_step_counts(bad)
            out["errors"].append("accepted")
        except ValueError as e:
            out["errors"].append(str(e))
    flat.remove_hooks()
    return out


def frozen_parameter_error() -> str:
    frozen = nn.Parameter(torch.randn(3, 3), requires_grad=False)
    try:
        FlatParams([("w", nn.Parameter(torch.randn(3, 3))), ("encoder.frozen", frozen)], dist.group.WORLD, shard=True)
    except Exception as e:  # noqa: BLE001 - the test checks which error, and that it names the parameter
        return f"{type(e).__name__}: {e}"
    return "accepted"


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        alone = [dist.new_group([r]) for r in range(WORLD)]  # every rank creates every group
        res = {key: train_against_ddp(rank, *cfg) for key, cfg in CONFIGS.items()}
        res["overlap"] = launches_during_backward_when_every_parameter_is_used()
        res["alone"] = train_alone(alone[rank])
        res["frozen_error"] = frozen_parameter_error()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


# ---- fixtures and tests -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("unused_params")
    # Spawned children unpickle the worker by module name: import this file under its plain name.
    sys.path.insert(0, str(Path(__file__).parent))
    worker = importlib.import_module(Path(__file__).stem)._worker
    spawn = importlib.import_module("parallel_spawn")  # fails instead of hanging
    spawn.spawn_with_deadline(worker, (spawn.free_port(), str(out_dir)), WORLD, SPAWN_DEADLINE_S)
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


@pytest.fixture(scope="module")
def reference():
    return train_reference()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("key", CONFIGS)
def test_gradient_used_on_one_rank_matches_ddp_with_find_unused_parameters(ranks, key):
    # A bucket complete on one rank and not on the other: every rank must still reduce the buckets in
    # one order (else gloo pairs different buckets: wrong gradients, or an abort when their sizes differ).
    for step in range(STEPS):
        checked = set()
        for r, res in enumerate(ranks):
            errors = res[key]["grad_errors"][step]
            bad = {n: e for n, e in errors.items() if e > GRAD_ATOL}
            assert not bad, f"{key} rank {r} step {step}: reduced gradient vs DDP off by {bad}"
            checked |= set(errors)
        assert checked == {n for n, _ in seeded_model().named_parameters()}  # the ranks' shards cover every parameter


@pytest.mark.parametrize("key", CONFIGS)
def test_parameter_without_gradient_on_any_rank_is_left_untouched_as_torch_adamw(ranks, reference, key):
    initial = dict(seeded_model().named_parameters())
    for name in ("early", "gate", "branch", "late"):  # used on one rank, some steps, or from step 2 on
        assert not torch.equal(reference[name], initial[name]), f"{name} never trained: the check would be blind"
    for r, res in enumerate(ranks):
        got = res[key]["weights"]
        assert torch.equal(got["never"], initial["never"]), f"{key} rank {r}: a parameter no rank used was updated"
        for name, want in reference.items():
            err = relative_error(got[name], want)
            assert err < WEIGHT_RTOL, f"{key} rank {r}: {name} differs from torch AdamW by {err:.2e}"
        if r:
            for name, w in got.items():
                assert torch.equal(w, ranks[0][key]["weights"][name]), f"{key}: the replicas of {name} diverged"


def test_buckets_still_launch_during_backward_when_every_parameter_has_a_gradient(ranks):
    for r, res in enumerate(ranks):
        launched, buckets = res["overlap"]
        assert buckets == 8 and launched == buckets, f"rank {r}: {launched} of {buckets} buckets launched before finish()"
        # With branches unused the held buckets wait for finish() (the count shows the hold is real).
        assert max(res["sharded"]["unreduced_at_finish"]) > 0


def test_world_size_one_leaves_parameters_without_gradient_untouched_as_torch_adamw(ranks):
    initial = dict(seeded_model().named_parameters())
    for r, res in enumerate(ranks):
        got, want = res["alone"]["weights"], res["alone"]["ref_weights"]
        assert torch.equal(got["never"], initial["never"])
        for name, w in want.items():
            err = relative_error(got[name], w)
            assert err < WEIGHT_RTOL, f"rank {r} alone: {name} differs from torch AdamW by {err:.2e}"


def test_per_parameter_step_counts_by_name_match_torch_adamw_and_reload(ranks):
    for r, res in enumerate(ranks):
        alone = res["alone"]
        counts = alone["step_counts"]
        assert counts == alone["ref_step_counts"], f"rank {r}: {counts} vs torch AdamW {alone['ref_step_counts']}"
        assert counts["never"] == 0 and counts["inp.weight"] == STEPS and 0 < counts["gate"] < STEPS  # they differ
        reloaded = alone["reloaded"]
        assert reloaded["counts"] == counts and reloaded["step_count"] == 9
        missing, unknown, negative = reloaded["errors"]
        assert "step counts: no count for ['gate']; expected one count for each of" in missing, missing
        assert "step counts: counts for ['gone'], which it does not hold; expected" in unknown, unknown
        assert "{'gate': -1}: expected integers >= 0" in negative, negative


def test_frozen_parameter_is_refused_naming_it(ranks):
    for res in ranks:
        assert res["frozen_error"].startswith("ValueError: "), res["frozen_error"]
        assert "requires_grad=False" in res["frozen_error"] and "encoder.frozen" in res["frozen_error"], res["frozen_error"]
        assert "leave frozen parameters out" in res["frozen_error"]


@pytest.mark.parametrize(
    ("layout", "world", "experts", "message"),
    [
        (ParallelLayout(dp=True), 1, 8, "dp=True must be a positive integer"),
        (ParallelLayout(dp=2, ep=True), 2, 8, "ep=True must be a positive integer"),
        (ParallelLayout(dp=2, pp=True), 2, 8, "pp=True must be a positive integer"),
        (ParallelLayout(dp=1), True, 8, "world_size=True must be a positive integer"),
        (ParallelLayout(dp=4, ep=1), 4, -1, "num_experts=-1 must be a non-negative integer"),
        (ParallelLayout(dp=4, ep=2), 4, -4, "num_experts=-4 must be a non-negative integer"),
        (ParallelLayout(dp=2, ep=2), 2, 4.0, "num_experts=4.0 must be a non-negative integer"),
    ],
)
def test_layout_refuses_bools_and_negative_expert_counts(layout, world, experts, message):
    with pytest.raises(ValueError, match=message):
        layout.validate(world, experts)
