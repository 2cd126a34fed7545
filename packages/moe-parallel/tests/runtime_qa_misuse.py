"""Misuse checks of test_runtime_qa.py, run by runtime_qa_worker.run_rank on 3 ranks: each returns the
error text (or "accepted") instead of raising, so one rank's verdict never leaves the others waiting."""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

from runtime_qa_worker import CFG, lr_at
from moe_parallel import (
    AdamWConfig,
    DistributedAdamW,
    FlatParams,
    GradientSync,
)
from outcome import outcome as _outcome


def _tiny(seed: int = 0, shapes: tuple = ((4, 3), (5,)), prefix: str = "p") -> list[tuple[str, nn.Parameter]]:
    torch.manual_seed(seed)
    return [(f"{prefix}{i}", nn.Parameter(torch.randn(*s))) for i, s in enumerate(shapes)]


def _stack(named, shard: bool = True, grad_dtype=None):  # noqa: ANN001, ANN202
    flat = FlatParams(named, dist.group.WORLD, shard=shard, grad_dtype=grad_dtype)
    return flat, GradientSync([flat], divisor=dist.get_world_size()), DistributedAdamW([flat], CFG, world=dist.group.WORLD)


def _backward(named, sync: GradientSync) -> None:  # noqa: ANN001
    sync.begin_backward(final=True)
    sum((p.float() ** 2).sum() for _, p in named).backward()
    sync.finish()


def misuse_step_order() -> dict:
    out = {}
    named = _tiny()
    flat, sync, opt = _stack(named)
    out["step_before_backward"] = _outcome(opt.step)
    _backward(named, sync)
    out["first_step"] = _outcome(opt.step)
    out["second_step_same_gradients"] = _outcome(opt.step)
    sync.zero_grads()
    out["step_after_zero_grads"] = _outcome(opt.step)
    _backward(named, sync)
    out["next_step"] = _outcome(opt.step)
    out["counts"] = opt.param_step_counts()
    sync.remove_hooks()
    return out


def misuse_registration() -> dict:
    out = {}
    named = _tiny()
    out["param_twice"] = _outcome(lambda: FlatParams(named + [("again", named[0][1])], dist.group.WORLD, shard=True))
    named = _tiny()
    out["param_twice_fp32_accumulation"] = _outcome(
        lambda: FlatParams([("a", named[0][1]), ("b", named[0][1])], dist.group.WORLD, shard=True, grad_dtype=torch.float64))
    named = _tiny()
    out["name_twice"] = _outcome(lambda: FlatParams([("p0", named[0][1]), ("p0", named[1][1])], dist.group.WORLD, shard=True))
    named = _tiny()
    flat_a = FlatParams(named, dist.group.WORLD, shard=True)
    flat_b = FlatParams(named[:1], dist.group.WORLD, shard=True)
    out["param_in_two_flats_sync"] = _outcome(lambda: GradientSync([flat_a, flat_b], divisor=1))
    out["param_in_two_flats_optimizer"] = _outcome(lambda: DistributedAdamW([flat_a, flat_b], CFG, world=dist.group.WORLD))
    out["no_flats_optimizer"] = _outcome(lambda: DistributedAdamW([], CFG, world=dist.group.WORLD))
    for value in (0, -3, True, 2.0):
        out[f"divisor_{value!r}"] = _outcome(lambda v=value: GradientSync([FlatParams(_tiny(), dist.group.WORLD, True)], divisor=v))
    for flat in (flat_a, flat_b):
        flat.remove_hooks()
    return out


def misuse_config() -> dict:
    bad = {"lr_negative": {"lr": -1e-3}, "lr_nan": {"lr": float("nan")}, "beta1_one": {"betas": (1.0, 0.95)},
           "beta2_negative": {"betas": (0.9, -0.1)}, "betas_three": {"betas": (0.9, 0.95, 0.99)},
           "eps_zero": {"eps": 0.0}, "weight_decay_negative": {"weight_decay": -0.1},
           "grad_clip_negative": {"grad_clip": -1.0}, "grad_clip_inf": {"grad_clip": float("inf")}}
    out = {k: _outcome(lambda kw=kw: AdamWConfig(**kw)) for k, kw in bad.items()}
    named = _tiny()
    flat, sync, opt = _stack(named)
    for key, lr in (("step_lr_nan", float("nan")), ("step_lr_negative", -0.5)):
        _backward(named, sync)
        out[key] = _outcome(lambda lr=lr: opt.step(lr))
        out[key + "_weights_finite"] = all(bool(torch.isfinite(p).all()) for _, p in named)
        sync.zero_grads()

    def set_count() -> None:
        opt.step_count = -1

    out["step_count_negative"] = _outcome(set_count)
    sync.remove_hooks()
    return out


def misuse_ranks_differ() -> dict:
    """Every rank runs this; the last rank's model differs. Each case must raise on every rank (no collective
    after a mismatch runs here: the old code, which checked nothing, would hang in the next one)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    last = rank == world - 1
    out = {}
    out["shape_transposed"] = _outcome(lambda: FlatParams(_tiny(shapes=((3, 4), (5,)) if last else ((4, 3), (5,))),
                                                          dist.group.WORLD, shard=True))
    out["extra_parameter"] = _outcome(lambda: FlatParams(_tiny(shapes=((4, 3), (5,), (2,)) if last else ((4, 3), (5,))),
                                                         dist.group.WORLD, shard=True))
    out["other_dtype"] = _outcome(lambda: FlatParams([(n, nn.Parameter(p.double() if last else p)) for n, p in _tiny()],
                                                     dist.group.WORLD, shard=True))
    # Expert flats over groups of one (ep = dp): only the optimizer's world-wide flags see the difference.
    alone = [dist.new_group([r]) for r in range(world)]

    def optimizer_with_extra_expert() -> None:
        dense = FlatParams(_tiny(), dist.group.WORLD, shard=True)
        experts = FlatParams(_tiny(shapes=((2, 3), (2,), (2, 2)) if last else ((2, 3), (2,)), prefix="experts.w"),
                             alone[rank], shard=True)
        DistributedAdamW([dense, experts], CFG, world=dist.group.WORLD)

    out["extra_expert_parameter"] = _outcome(optimizer_with_extra_expert)
    # Same shapes, other values (a rank seeded differently): the replicas must start identical, as with torch DDP.
    for shard in (True, False):
        named = _tiny(seed=rank)
        flat = FlatParams(named, dist.group.WORLD, shard=shard)
        gathered = [torch.zeros_like(flat.param_buffer) for _ in range(world)]
        dist.all_gather(gathered, flat.param_buffer)
        out[f"replicas_identical_shard={shard}"] = all(torch.equal(gathered[0], g) for g in gathered)
        out[f"rank0_values_shard={shard}"] = torch.equal(named[0][1].detach(), _tiny(seed=0)[0][1].detach())
        flat.remove_hooks()
    return out


def misuse_two_backwards_in_last_micro_batch() -> dict:
    """Two backward() calls after begin_backward(final=True) (one loss at a time, or a reentrant checkpoint):
    a and b share one bucket. In the second backward a's gradient arrives first; the bucket may launch only
    once b's has arrived too. When a gets a gradient after its bucket was launched, that must be an error."""
    out = {}
    world = dist.get_world_size()
    for shard in (True, False):
        a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
        launched_when_b_arrived = []
        flat_holder: list[FlatParams] = []
        # registered before FlatParams' own hook, so it sees the bucket as b's gradient arrives
        watch = b.register_post_accumulate_grad_hook(lambda _: launched_when_b_arrived.append(
            flat_holder[0].buckets[0].handle is not None) if sync.final else None)
        flat = FlatParams([("a", a), ("b", b)], dist.group.WORLD, shard=shard, bucket_numel=1 << 20)
        flat_holder.append(flat)
        sync = GradientSync([flat], divisor=world)
        sync.begin_backward(final=True)
        (a * 2).sum().backward()
        # b's branch is built first, so in backward a's gradient (built later) is accumulated first
        ((b * 5).sum() + (a * 3).sum()).backward()
        sync.finish()
        shard_grad = flat.buckets[0].grad_shard.clone()
        full = [torch.zeros_like(shard_grad) for _ in range(world)] if shard else None
        if shard:
            dist.all_gather(full, shard_grad)
            reduced = torch.cat(full)
        else:
            reduced = flat.grad_buffer.clone()
        want = torch.zeros_like(reduced)
        for s in flat.slots:
            want[s.start : s.start + s.numel] = 5.0  # a: 2 + 3, b: 5; summed over ranks and divided by the world
        out[f"legit_shard={shard}_launched_before_b"] = launched_when_b_arrived
        out[f"legit_shard={shard}_grad_ok"] = bool(torch.allclose(reduced, want))
        sync.remove_hooks()
        # b's C++ hook closes over flat_holder and sync, which hold b: a cycle gc cannot see, keeping the flat's
        # process group (and its gloo threads) alive into interpreter exit
        watch.remove()

        # now a second gradient for a after its bucket was launched
        a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
        flat = FlatParams([("a", a), ("b", b)], dist.group.WORLD, shard=shard)
        sync = GradientSync([flat], divisor=world)
        sync.begin_backward(final=True)
        ((a + b) * 2).sum().backward()  # both arrive: the bucket is launched

        def late() -> None:
            (a * 3).sum().backward()
            sync.finish()

        out[f"late_shard={shard}"] = _outcome(late)
        for bucket in flat.buckets:  # the launched reduction completes on every rank either way
            if bucket.handle is not None:
                bucket.handle.wait()
        sync.remove_hooks()
    return out


def misuse_torch_habits() -> dict:
    """model.zero_grad() (torch's set_to_none) before each step, as with any torch optimizer: the gradients must still
    reach the flat buffer. Rebinding a parameter's data after FlatParams (param.data = ..., model.to()) must fail."""
    out = {}
    for habit in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        flat = FlatParams(list(model.named_parameters()), dist.group.WORLD, shard=True)
        sync = GradientSync([flat], divisor=dist.get_world_size())
        opt = DistributedAdamW([flat], CFG, world=dist.group.WORLD)
        norms = []
        for step in range(3):
            if habit:
                model.zero_grad()
            for m in range(2):
                sync.begin_backward(final=m == 1)
                g = torch.Generator().manual_seed(10 * step + m + 100 * dist.get_rank())
                (model(torch.randn(5, 4, generator=g)).pow(2).mean() / 2).backward()
            sync.finish()
            norms.append(opt.step(lr_at(step)).grad_norm)
            sync.zero_grads()
        out[f"zero_grad={habit}"] = {"norms": norms, "weights": [p.detach().clone() for p in model.parameters()]}
        sync.remove_hooks()
    named = _tiny()
    flat, sync, opt = _stack(named)
    named[1][1].data = named[1][1].data.clone()
    out["rebound"] = _outcome(lambda: _backward(named, sync))
    sync.remove_hooks()
    return out


MISUSE = (misuse_step_order, misuse_registration, misuse_config, misuse_ranks_differ,
          misuse_two_backwards_in_last_micro_batch, misuse_torch_habits)


# ---- the spawned rank ------------------------------------------------------------------------------
