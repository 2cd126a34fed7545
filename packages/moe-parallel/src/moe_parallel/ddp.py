"""Resident-weight data parallelism: local gradient accumulation, one bucketed reduction per step.

Over the micro-batches of an optimizer step gradients accumulate into the flat gradient
buffers with no communication. On the last micro-batch each bucket is reduced once: a
reduce-scatter when the optimizer state is sharded (ZeRO-1), an all-reduce otherwise. Dense
gradients go over dense data parallelism, expert gradients over expert data parallelism.

Overlap: with `overlap=True`, a post-accumulate-grad hook counts the parameters of each bucket
during the last backward and launches the bucket's reduction (async) as soon as its last
gradient lands, so reduction of late layers runs while early layers are still in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_parallel.buffers import Bucket, FlatParams


class _Done:
    def wait(self) -> None:
        pass


_DONE = _Done()


class GradientSync:
    """Owns the gradient buffers' life cycle across micro-batches.

    flats: the replication groups (e.g. [dense, experts]).
    divisor: gradients are summed over the group then divided by this (the dense dp size:
             the loss is a mean over all data-parallel ranks, also for expert gradients).
    """

    def __init__(self, flats: list[FlatParams], divisor: int, overlap: bool = True):
        self.flats = flats
        self.divisor = divisor
        self.overlap = overlap
        self.final = False
        self.reductions = 0  # collectives launched for gradients (for tests and metrics)
        self._hooks = []
        for flat in flats:
            if flat.grads_bound and not overlap:
                continue  # autograd accumulates in place into the buffer views; nothing to do
            for slot in flat.slots:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._make_hook(flat, slot)))

    def _make_hook(self, flat: FlatParams, slot):  # noqa: ANN001, ANN202
        bucket = flat.buckets[slot.bucket]

        def hook(param: torch.Tensor) -> None:
            if not flat.grads_bound:  # fp32 accumulation of a lower-precision gradient
                flat.grad_view(slot).add_(param.grad)
                param.grad = None
            if self.final and self.overlap:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch(flat, bucket)

        return hook

    def begin_backward(self, final: bool) -> None:
        """Call before each micro-batch's backward; final=True on the last of the optimizer step."""
        self.final = final

    def _launch(self, flat: FlatParams, bucket: Bucket) -> None:
        if flat.group_size == 1:  # nothing to reduce: world size 1 costs no collective
            bucket.handle = _DONE
            return
        chunk = flat.grad_buffer[bucket.start : bucket.start + bucket.numel]
        if flat.shard:
            bucket.handle = dist.reduce_scatter_tensor(bucket.grad_shard, chunk, group=flat.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(chunk, group=flat.group, async_op=True)
        self.reductions += 1

    def finish(self) -> None:
        """After the last backward: reduce every bucket not yet launched, wait, and average."""
        for flat in self.flats:
            for bucket in flat.buckets:
                if bucket.handle is None:
                    self._launch(flat, bucket)
        for flat in self.flats:
            for bucket in flat.buckets:
                bucket.handle.wait()
                bucket.handle = None
                if self.divisor != 1:
                    bucket.grad_shard.div_(self.divisor)
        self.final = False

    def zero_grads(self) -> None:
        for flat in self.flats:
            flat.zero_grads()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
