"""Flat parameter and gradient buffers split into buckets, each bucket sharded over a group.

Every parameter of one replication group (dense params over dense DP, expert params over
expert DP) becomes a view into one flat parameter buffer, and its gradient a view into one
flat gradient buffer, so a bucket is reduced with a single collective and the model weights
are refreshed with a single all-gather per bucket. Bucket b of size n (a multiple of the
group size g) is owned in g equal shards: rank r owns [start + r*n/g, start + (r+1)*n/g).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

ALIGN = 64  # elements: every param view and shard starts 128/256-byte aligned (grouped GEMMs want 16)


@dataclass
class ParamSlot:
    """One parameter's place in the flat buffers: elements [start, start + numel)."""

    name: str
    param: nn.Parameter
    start: int
    numel: int
    bucket: int
    index: int  # position in FlatParams.slots
    has_grad: bool = False  # a gradient reached this parameter on this rank since the last zero_grads()


@dataclass
class Bucket:
    """Elements [start, start + numel) of the flat buffers; this rank owns [shard_start, shard_start + shard_numel)."""

    start: int
    numel: int
    shard_start: int
    shard_numel: int
    slots: list[ParamSlot] = field(default_factory=list)
    grad_shard: torch.Tensor | None = None  # [shard_numel] reduced gradient (a view of the grad buffer when unsharded)
    pending: int = 0  # GradientSync: parameters whose gradient has not yet arrived in the last backward
    handle: dist.Work | None = None  # GradientSync: the bucket's reduction, once launched


class FlatParams:
    """Parameters of one replication group laid out in flat, bucketed buffers.

    named_params: (name, param) in forward order, all one dtype and device, all requires_grad=True.
    group: the process group the gradients are reduced over (and state sharded over when shard=True).
    grad_dtype: dtype of the accumulation buffer (fp32 for fp32 gradient accumulation).

    A post-accumulate-grad hook on every parameter adds a lower-precision gradient into the fp32
    buffer and records that the parameter received a gradient (`ParamSlot.has_grad`): the
    optimizer leaves a parameter that no rank gave a gradient untouched, as torch.optim.AdamW does.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup,
        shard: bool,
        grad_dtype: torch.dtype | None = None,
        bucket_numel: int = 1 << 25,
    ):
        if not named_params:
            raise ValueError("FlatParams needs at least one parameter")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one group must share a dtype, got {sorted(map(str, dtypes))}")
        frozen = [n for n, p in named_params if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"FlatParams got parameters with requires_grad=False: {frozen}; leave frozen parameters out "
                "(e.g. [(n, p) for n, p in model.named_parameters() if p.requires_grad]): they never get a "
                "gradient, and the optimizer must not update them"
            )
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        self.shard = shard and self.group_size > 1  # a group of one keeps the whole bucket
        self.param_dtype = named_params[0][1].dtype
        self.grad_dtype = grad_dtype or self.param_dtype
        device = named_params[0][1].device
        shards = self.group_size if self.shard else 1
        self.slots: list[ParamSlot] = []
        self.buckets: list[Bucket] = []
        # Reverse order: gradients become ready roughly last layer first.
        cursor, bucket_start = 0, 0
        for name, p in reversed(named_params):
            if cursor > bucket_start and cursor + p.numel() - bucket_start > bucket_numel:
                bucket_start = cursor = self._close_bucket(bucket_start, cursor, shards)
            self.slots.append(ParamSlot(name, p, cursor, p.numel(), len(self.buckets), len(self.slots)))
            cursor = _round_up(cursor + p.numel(), ALIGN)
        total = self._close_bucket(bucket_start, cursor, shards)

        self.param_buffer = torch.zeros(total, dtype=self.param_dtype, device=device)
        self.grad_buffer = torch.zeros(total, dtype=self.grad_dtype, device=device)
        for slot in self.slots:
            self.buckets[slot.bucket].slots.append(slot)
            view = self.param_view(slot)
            view.copy_(slot.param.detach())
            slot.param.data = view
        self.grads_bound = self.grad_dtype == self.param_dtype
        for b in self.buckets:
            b.grad_shard = (
                torch.empty(b.shard_numel, dtype=self.grad_dtype, device=device)
                if self.shard else self.grad_buffer[b.start : b.start + b.numel]
            )
        self._hooks = [slot.param.register_post_accumulate_grad_hook(self._make_hook(slot)) for slot in self.slots]
        self.zero_grads()

    def _make_hook(self, slot: ParamSlot):  # noqa: ANN202
        def hook(param: torch.Tensor) -> None:
            if not self.grads_bound:  # fp32 accumulation of a lower-precision gradient
                self.grad_view(slot).add_(param.grad)
                param.grad = None
            slot.has_grad = True

        return hook

    def remove_hooks(self) -> None:
        """At the end of training: gradients stop reaching the fp32 buffer and being recorded."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _close_bucket(self, start: int, end: int, shards: int) -> int:
        numel = _round_up(max(end - start, 1), ALIGN * shards)
        shard_numel = numel // shards
        rank = self.group_rank if self.shard else 0
        self.buckets.append(Bucket(start, numel, start + rank * shard_numel, shard_numel))
        return start + numel

    @property
    def owns_unique_shard(self) -> bool:
        """True when no other rank of the group holds this rank's optimizer shard (counts it once in norms)."""
        return self.shard or self.group_rank == 0

    def param_view(self, slot: ParamSlot) -> torch.Tensor:
        return self.param_buffer[slot.start : slot.start + slot.numel].view(slot.param.shape)

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        return self.grad_buffer[slot.start : slot.start + slot.numel].view(slot.param.shape)

    def bind_grads(self) -> None:
        """Point each .grad at its buffer view, so autograd accumulates in place (same-dtype case)."""
        if self.grads_bound:
            for slot in self.slots:
                slot.param.grad = self.grad_view(slot)

    def zero_grads(self) -> None:
        self.grad_buffer.zero_()
        for slot in self.slots:
            slot.has_grad = False
        self.bind_grads()


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
