"""Distributed AdamW (ZeRO-1): fp32 master weights and moments sharded like the gradients (fp64 for fp64 weights).

Each rank updates only the shard of every bucket it owns (after the gradient reduce-scatter),
then all-gathers the updated shard into the model's flat parameter buffer, so every replica
leaves the step with identical weights in the model's dtype (bf16 or fp32). The update is
torch's fused AdamW kernel (`torch._fused_adamw_`, CUDA and CPU) on views of each fp32 shard:
one pass over master, moments and gradient, no temporaries; decoupled decay on matrices only.

Global-norm clipping: every rank adds the squared norm of the gradient shards it uniquely owns
(dense and expert groups alike) and one all-reduce over the world gives the global norm. A
non-finite norm skips the whole step on every rank (they all see the same norm) and is counted.
The clip factor is the fused kernel's grad_scale: no extra pass over the gradients.

Parameters without a gradient: as torch.optim.AdamW skips a parameter whose .grad is None, a
parameter that received no gradient on any rank during the step (FlatParams records each
arrival) keeps its weights, moments and step count. The same all-reduce carries one flag per
parameter, so every rank agrees; a parameter used on at least one rank is updated with the mean
over ranks, zeros from the others (torch DDP with find_unused_parameters). An expert parameter
counts as used when any rank's slice of it got a gradient, as the whole tensor would on one
process. Step counts are per parameter, as torch's bias correction is; param_step_counts() /
load_param_step_counts() carry them through a checkpoint by parameter name, and state_pieces() the masters
and moments, in global coordinates (optimizer_state.py).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_parallel.buffers import (
    Bucket,
    FlatParams,
    collective_device,
    refuse_shared_parameters,
    require_same_on_every_rank,
)
from moe_parallel.optimizer_state import OptimizerStatePiece, state_pieces


@dataclass
class AdamWConfig:
    """Checked on construction and again at every DistributedAdamW.step (a field assigned since is checked too; a
    ValueError names the value): beta1 = 1 would divide by a zero bias correction and eps = 0 would divide 0 by 0
    for a zero gradient, both turning weights into NaN."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still computed and reported)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_lr(self.lr, "AdamWConfig: lr")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2 or not all(
            _is_real(b) and 0 <= b < 1 for b in self.betas
        ):
            raise ValueError(f"AdamWConfig: betas={self.betas!r} must be two numbers in [0, 1)")
        for name, value, rule in (("eps", self.eps, "> 0"), ("weight_decay", self.weight_decay, ">= 0"),
                                  ("grad_clip", self.grad_clip, ">= 0 (0 disables clipping)")):
            ok = _is_real(value) and math.isfinite(value) and (value > 0 if name == "eps" else value >= 0)
            if not ok:
                raise ValueError(f"AdamWConfig: {name}={value!r} must be a finite number {rule}")


@dataclass
class _ShardState:
    """fp32 state of one bucket shard: [shard_numel] each; decay / no_decay: (lo, hi, slot index)
    for each parameter's piece of the shard, matrices (weight decay) and vectors (none)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: list[tuple[int, int, int]]
    no_decay: list[tuple[int, int, int]]


@dataclass
class OptimizerStepResult:
    grad_norm: float
    skipped: bool


class DistributedAdamW:
    """AdamW over FlatParams groups; world: the group spanning every rank (for the global norm and
    the per-parameter "received a gradient" flags: every rank holds the same parameters, slot for
    slot, expert parameters as its own slice)."""

    def __init__(self, flats: list[FlatParams], cfg: AdamWConfig, world: dist.ProcessGroup | None = None):
        if world is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"DistributedAdamW needs world= (e.g. groups.world) in a job of {dist.get_world_size()} ranks: "
                "the global gradient norm, the clipping and the skip of a non-finite step must span every rank"
            )
        if world is None:
            _require_config(cfg)
            refuse_shared_parameters(flats, "DistributedAdamW")
        else:
            try:
                _require_config(cfg)
                refuse_shared_parameters(flats, "DistributedAdamW")
                _refuse_groups_outside(flats, world)
            except (TypeError, ValueError) as refusal:  # the other ranks, meeting this one in the check below, raise
                require_same_on_every_rank(world, [], "DistributedAdamW: the parameters", collective_device(world),
                                           refusal)
                raise
            # the per-parameter flags ride one all-reduce over the world: same slots everywhere; and the same
            # hyper-parameters (another clip or decay on one rank would make its replicas drift apart silently)
            require_same_on_every_rank(
                world, [f"config {cfg!r}"] + [f"flats[{i}] {s.name!r} {tuple(s.param.shape)} {s.param.dtype}"
                                              for i, f in enumerate(flats)
                                              for s in reversed(f.slots)],  # in the order given (laid out reversed)
                "DistributedAdamW: the config and the parameters (expert parameters as this rank's slice)",
                flats[0].param_buffer.device,
            )
        self.flats = flats
        self.cfg = cfg
        self.world = world
        self._step_count = 0
        self.skipped_steps = 0
        self.states: list[list[_ShardState]] = [[self._init_shard(f, b) for b in f.buckets] for f in flats]
        # the global norm in fp32, or fp64 when a group's masters are (the same on every rank: dtypes are checked)
        self._norm_dtype = torch.float64 if any(_master_dtype(f) == torch.float64 for f in flats) else torch.float32
        # Per flat and slot (torch AdamW's state["step"]): only parameters that received a gradient advance.
        self.param_steps: list[list[int]] = [[0] * len(f.slots) for f in flats]

    @property
    def step_count(self) -> int:
        """Steps taken (not skipped)."""
        return self._step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        """Sets every parameter's count too (a checkpoint that holds only this one count)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"step_count={value!r}: expected an integer >= 0")
        self._step_count = value
        self.param_steps = [[value] * len(f.slots) for f in self.flats]

    def param_step_counts(self) -> dict[str, int]:
        """{parameter name: its step count}: the same on every rank (an expert parameter counts as a whole),
        and keyed by name, so it can be saved once and restored on any parallel layout."""
        return {slot.name: n for flat, steps in zip(self.flats, self.param_steps) for slot, n in zip(flat.slots, steps)}

    def load_param_step_counts(self, counts: Mapping[str, int]) -> None:
        """Restore per-parameter step counts from param_step_counts() output (of any layout); every parameter
        of this optimizer must be named, and nothing else. step_count (steps taken) is left as it is."""
        names = [slot.name for flat in self.flats for slot in flat.slots]
        missing = [n for n in names if n not in counts]
        unknown = sorted(set(counts) - set(names))
        if missing or unknown:
            wrong = [f"no count for {missing}"] if missing else []
            wrong += [f"counts for {unknown}, which it does not hold"] if unknown else []
            raise ValueError(f"step counts: {'; '.join(wrong)}; expected one count for each of this optimizer's "
                             f"{len(names)} parameters")
        bad = {n: v for n, v in counts.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0}
        if bad:
            raise ValueError(f"step counts {bad}: expected integers >= 0")
        self.param_steps = [[counts[slot.name] for slot in flat.slots] for flat in self.flats]

    @staticmethod
    def _init_shard(flat: FlatParams, bucket: Bucket) -> _ShardState:
        lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_numel
        # fp32, or the weights' own dtype when wider (fp64 weights kept at fp32 precision would drift from torch AdamW)
        master = flat.param_buffer[lo:hi].to(_master_dtype(flat), copy=True)
        decay, no_decay = [], []
        for slot in bucket.slots:
            a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if a < b:  # as param_groups(): decay matrices, never vectors; padding is never updated
                (decay if slot.param.dim() >= 2 else no_decay).append((a - lo, b - lo, slot.index))
        return _ShardState(master, torch.zeros_like(master), torch.zeros_like(master), decay, no_decay)

    def state_pieces(self) -> list[OptimizerStatePiece]:
        """This rank's masters and moments in global coordinates, as views into the optimizer's state.

        Save (every rank): for each piece with owner=True, elements [offset, offset + numel) of the flattened
        global tensor (name, key) of global_shape are piece.tensor; with param_step_counts() and step_count
        (the same on every rank) that is the whole state. Load, on any layout (other dp, ep or bucket sizes),
        every rank: piece.tensor.copy_(saved[name, key].reshape(-1)[offset : offset + numel]) for every piece
        (owner or not), then step_count = n (it sets every parameter's count), load_param_step_counts(counts),
        and refresh_weights() (collective) to derive the model weights from the loaded masters.
        """
        return state_pieces(self.flats, self.states)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 master + both moments (12 B per owned element; 24 for fp64)."""
        return sum(s.master.numel() * 3 * s.master.element_size() for states in self.states for s in states)

    @torch.no_grad()
    def global_grad_norm(self) -> torch.Tensor:
        """0-dim fp32 norm over every gradient of the model, each element counted once."""
        return self._reduce_over_world(self._local_squared_norm()).sqrt()

    def _local_squared_norm(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=self._norm_dtype, device=self.flats[0].param_buffer.device)
        for flat in self.flats:
            if flat.owns_unique_shard:
                for b in flat.buckets:
                    g = b.grad_shard.to(self._norm_dtype)
                    sq += torch.dot(g, g)
        return sq

    def _reduce_over_world(self, t: torch.Tensor) -> torch.Tensor:
        if self.world is not None and dist.get_world_size(self.world) > 1:
            dist.all_reduce(t, group=self.world)
        return t

    @torch.no_grad()
    def _norm_and_received(self, refuse: bool = False) -> tuple[float, list[list[bool]], bool]:
        """The global norm, per flat and slot whether any rank gave the parameter a gradient, and whether any rank
        refuses the step (`refuse` on this one): one all-reduce."""
        flags = torch.tensor([float(slot.has_grad) for flat in self.flats for slot in flat.slots] + [float(refuse)],
                             dtype=self._norm_dtype, device=self.flats[0].param_buffer.device)
        both = torch.cat([self._local_squared_norm().view(1), flags])
        self._reduce_over_world(both)[0].sqrt_()
        values = both.tolist()  # the one host sync of the step: skip or not must be known on the host
        received, at = [], 1
        for flat in self.flats:
            received.append([v > 0 for v in values[at : at + len(flat.slots)]])
            at += len(flat.slots)
        return values[0], received, values[-1] > 0

    @torch.no_grad()
    def step(self, lr: float | None = None) -> OptimizerStepResult:
        """Update from the reduced gradient shards, then refresh the model weights.

        Call after GradientSync.finish(), once per finish(); the gradient buffers are left for the caller to zero.
        """
        cfg = self.cfg
        try:  # refused on every rank, through the norm's all-reduce: raised here alone, the others would wait in it
            _require_config(cfg)
            lr = cfg.lr if lr is None else lr
            cfg.validate()
            _check_lr(lr, "DistributedAdamW.step: lr")
            refusal = None
        except Exception as err:  # noqa: BLE001 - any refusal (a TypeError, an OverflowError): raised below, every rank
            refusal = err
        stale = [i for i, flat in enumerate(self.flats) if not flat.reduced]
        if stale:
            raise RuntimeError(
                f"DistributedAdamW.step(): the gradients of flats{stale} were not reduced for this step; expected "
                "GradientSync.finish() after the last micro-batch's backward, then one step(), then zero_grads() "
                "(a step without it would read the last step's gradients again, or uninitialised memory)"
            )
        norm_value, received, refused = self._norm_and_received(refusal is not None)
        if refused:  # nothing changed: the gradients stay reduced for a step with a valid lr and config
            raise refusal if refusal is not None else ValueError(
                f"DistributedAdamW.step: another rank refused its lr or AdamWConfig (its error names the value; "
                f"this rank's lr={lr!r}); no rank updated its weights")
        for flat in self.flats:  # this step consumes them: a second step() before the next finish() is refused
            flat.reduced = False
            flat.stepped = True  # and the next step's first backward wants them cleared by zero_grads()
        if not math.isfinite(norm_value):
            self.skipped_steps += 1
            return OptimizerStepResult(norm_value, True)
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        coef = min(clip / (norm_value + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
        device = self.flats[0].param_buffer.device
        # clipping folded into the fused update (no pass that rewrites every gradient shard)
        grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=device) if coef < 1.0 else None
        self._step_count += 1
        beta1, beta2 = cfg.betas
        step_tensors: dict[int, torch.Tensor] = {}  # one per distinct count (usually one), as the kernel wants tensors
        for flat, states, steps, got in zip(self.flats, self.states, self.param_steps, received):
            steps[:] = [n + 1 if g else n for n, g in zip(steps, got)]
            for n in set(steps):
                if n not in step_tensors:
                    step_tensors[n] = torch.full((), float(n), dtype=torch.float32, device=device)
            for bucket, st in zip(flat.buckets, states):
                g = bucket.grad_shard.to(st.master.dtype)  # no copy when the dtypes match
                scale = grad_scale
                if scale is not None and st.master.dtype == torch.float64:  # the kernel takes an fp32 grad_scale only:
                    g, scale = g * coef, None  # fp64 clips in fp64, as torch's clip_grad_norm_ (an fp32 1/coef was
                    # off by 5e-10 from torch's fp64 AdamW, review helper 173)
                for pieces, decay in ((st.decay, cfg.weight_decay), (st.no_decay, 0.0)):
                    ranges = _received_ranges(pieces, got, steps)
                    if ranges:
                        views = [[t[a:b] for a, b, _ in ranges] for t in (st.master, g, st.exp_avg, st.exp_avg_sq)]
                        torch._fused_adamw_(
                            *views, [], [step_tensors[n] for _, _, n in ranges], lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=decay, eps=cfg.eps, amsgrad=False, maximize=False,
                            grad_scale=scale,  # the kernel divides each gradient by it as it reads it
                        )
            self._refresh(flat, states)
        return OptimizerStepResult(norm_value, False)

    def _refresh(self, flat: FlatParams, states: list[_ShardState]) -> None:
        """Write the updated masters into the model's flat parameter buffer on every replica."""
        for bucket, st in zip(flat.buckets, states):
            chunk = flat.param_buffer[bucket.start : bucket.start + bucket.numel]
            if flat.shard:
                dist.all_gather_into_tensor(chunk, st.master.to(flat.param_dtype), group=flat.group)
            else:
                chunk.copy_(st.master)

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Write the fp32 masters into the model weights on every replica (after loading masters from elsewhere:
        the weights are then the masters, rounded to their dtype). Every rank of the flats' groups calls it."""
        for flat, states in zip(self.flats, self.states):
            self._refresh(flat, states)

    def reload_masters(self) -> None:
        """Re-read the fp32 masters from the model weights (after loading weights from elsewhere)."""
        for flat, states in zip(self.flats, self.states):
            for bucket, st in zip(flat.buckets, states):
                st.master.copy_(flat.param_buffer[bucket.shard_start : bucket.shard_start + bucket.shard_numel])


def _refuse_groups_outside(flats: list[FlatParams], world: dist.ProcessGroup) -> None:
    """A norm over fewer ranks than the gradients span would differ between ranks: other clip factors, or a skip
    on some ranks only (which then leave the others waiting in the weight all-gather)."""
    world_ranks = dist.get_process_group_ranks(world)
    for i, flat in enumerate(flats):
        outside = sorted(set(dist.get_process_group_ranks(flat.group)) - set(world_ranks))
        if outside:
            raise ValueError(f"DistributedAdamW: flats[{i}] is reduced over ranks {outside} outside world= "
                             f"(ranks {world_ranks}); expected world= to span every rank (groups.world)")


def _master_dtype(flat: FlatParams) -> torch.dtype:
    """fp32 masters for bf16 / fp16 / fp32 weights; fp64 weights keep fp64 masters."""
    return torch.promote_types(flat.param_dtype, torch.float32)


def _is_real(value: object) -> bool:
    """A Python or NumPy number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require_config(cfg: object) -> None:
    """None (or the trainer's own config) was accepted and failed at the first step, on a missing attribute."""
    if not isinstance(cfg, AdamWConfig):
        raise TypeError(f"DistributedAdamW: cfg is a {type(cfg).__name__}, expected an AdamWConfig (e.g. "
                        "AdamWConfig(lr=3e-4, weight_decay=0.1))")


def _check_lr(lr: object, what: str) -> None:
    if not (_is_real(lr) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{what}={lr!r} must be a finite number >= 0")


def _received_ranges(pieces: list[tuple[int, int, int]], got: list[bool], steps: list[int]) -> list[tuple[int, int, int]]:
    """(lo, hi, step count) of the pieces whose parameter received a gradient; neighbouring slots with one
    step count merge into one range (only alignment padding, always zero, lies between them)."""
    out: list[tuple[int, int, int]] = []
    last = -2
    for a, b, i in pieces:
        if got[i]:
            if i == last + 1 and out[-1][2] == steps[i]:
                out[-1] = (out[-1][0], b, steps[i])
            else:
                out.append((a, b, steps[i]))
            last = i
    return out
