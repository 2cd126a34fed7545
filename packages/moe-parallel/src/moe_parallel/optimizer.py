"""Distributed AdamW (ZeRO-1): fp32 master weights and moments sharded like the gradients.

Each rank updates only the shard of every bucket it owns (after the gradient reduce-scatter),
then all-gathers the updated shard into the model's flat parameter buffer, so every replica
leaves the step with identical weights in the model's dtype (bf16 or fp32). The update is
torch's fused AdamW kernel (`torch._fused_adamw_`, CUDA and CPU) on views of each fp32 shard:
one pass over master, moments and gradient, no temporaries; decoupled decay on matrices only.

Global-norm clipping: every rank adds the squared norm of the gradient shards it uniquely owns
(dense and expert groups alike) and one all-reduce over the world gives the global norm. A
non-finite norm skips the whole step on every rank (they all see the same norm) and is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_parallel.buffers import Bucket, FlatParams


@dataclass
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still computed and reported)


@dataclass
class _ShardState:
    """fp32 state of one bucket shard: [shard_numel] each; decay / no_decay: (lo, hi) ranges that
    partition the shard into elements with and without weight decay."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: list[tuple[int, int]]
    no_decay: list[tuple[int, int]]


@dataclass
class OptimizerStepResult:
    grad_norm: float
    skipped: bool


class DistributedAdamW:
    """AdamW over FlatParams groups; world: the group spanning every rank (for the global norm)."""

    def __init__(self, flats: list[FlatParams], cfg: AdamWConfig, world: dist.ProcessGroup | None = None):
        if world is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"DistributedAdamW needs world= (e.g. groups.world) in a job of {dist.get_world_size()} ranks: "
                "the global gradient norm, the clipping and the skip of a non-finite step must span every rank"
            )
        self.flats = flats
        self.cfg = cfg
        self.world = world
        self.step_count = 0
        self.skipped_steps = 0
        self.states: list[list[_ShardState]] = [[self._init_shard(f, b) for b in f.buckets] for f in flats]

    @staticmethod
    def _init_shard(flat: FlatParams, bucket: Bucket) -> _ShardState:
        lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_numel
        master = flat.param_buffer[lo:hi].to(torch.float32, copy=True)
        decay = []
        for slot in bucket.slots:
            a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if a < b and slot.param.dim() >= 2:  # as param_groups(): decay matrices, never vectors
                decay.append((a - lo, b - lo))
        decay.sort()
        no_decay, at = [], 0
        for a, b in decay:
            if at < a:
                no_decay.append((at, a))
            at = b
        if at < hi - lo:
            no_decay.append((at, hi - lo))
        return _ShardState(master, torch.zeros_like(master), torch.zeros_like(master), decay, no_decay)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 master + both moments (12 B per owned element)."""
        return sum(s.master.numel() * 3 * 4 for states in self.states for s in states)

    @torch.no_grad()
    def global_grad_norm(self) -> torch.Tensor:
        """0-dim fp32 norm over every gradient of the model, each element counted once."""
        device = self.flats[0].param_buffer.device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for flat in self.flats:
            if flat.owns_unique_shard:
                for b in flat.buckets:
                    g = b.grad_shard.float()
                    sq += torch.dot(g, g)
        if self.world is not None and dist.get_world_size(self.world) > 1:
            dist.all_reduce(sq, group=self.world)
        return sq.sqrt()

    @torch.no_grad()
    def step(self, lr: float | None = None) -> OptimizerStepResult:
        """Update from the reduced gradient shards, then refresh the model weights.

        Call after GradientSync.finish(); the gradient buffers are left for the caller to zero.
        """
        cfg = self.cfg
        lr = cfg.lr if lr is None else lr
        norm = self.global_grad_norm()
        norm_value = float(norm)  # the one host sync of the step: skip or not must be known on the host
        if not math.isfinite(norm_value):
            self.skipped_steps += 1
            return OptimizerStepResult(norm_value, True)
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        coef = min(clip / (norm_value + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
        self.step_count += 1
        beta1, beta2 = cfg.betas
        device = self.flats[0].param_buffer.device
        step = torch.full((), float(self.step_count), dtype=torch.float32, device=device)
        for flat, states in zip(self.flats, self.states):
            for bucket, st in zip(flat.buckets, states):
                g = bucket.grad_shard
                g = g.float() if g.dtype != torch.float32 else g  # an fp32 shard is scaled in place (zeroed after the step)
                if coef < 1.0:
                    g.mul_(coef)
                for ranges, decay in ((st.decay, cfg.weight_decay), (st.no_decay, 0.0)):
                    if ranges:
                        views = [[t[a:b] for a, b in ranges] for t in (st.master, g, st.exp_avg, st.exp_avg_sq)]
                        torch._fused_adamw_(
                            *views, [], [step] * len(ranges), lr=lr, beta1=beta1, beta2=beta2, weight_decay=decay,
                            eps=cfg.eps, amsgrad=False, maximize=False,
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

    def reload_masters(self) -> None:
        """Re-read the fp32 masters from the model weights (after loading weights from elsewhere)."""
        for flat, states in zip(self.flats, self.states):
            for bucket, st in zip(flat.buckets, states):
                st.master.copy_(flat.param_buffer[bucket.shard_start : bucket.shard_start + bucket.shard_numel])
