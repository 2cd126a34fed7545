"""Resident-weight data parallelism: local gradient accumulation, one bucketed reduction per step.

Over the micro-batches of an optimizer step gradients accumulate into the flat gradient
buffers with no communication. On the last micro-batch each bucket is reduced once: a
reduce-scatter when the optimizer state is sharded (ZeRO-1), an all-reduce otherwise. Dense
gradients go over dense data parallelism, expert gradients over expert data parallelism.

Overlap: with `overlap=True`, a post-accumulate-grad hook counts the parameters of each bucket
during the last backward; when a bucket is complete and every bucket before it has been
launched, it launches the bucket's reduction (async) and then any complete buckets after it, so
reduction of late layers runs while early layers are still in backward. Every rank of a group
launches the group's buckets in bucket order: a parameter that got no gradient on some rank
(a data-dependent branch) holds that bucket, and the ones after it, until `finish()` launches
them in the same order, with zeros from that rank (what torch DDP with find_unused_parameters
reduces).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from moe_parallel.buffers import Bucket, FlatParams, ParamSlot, refuse_shared_parameters


class _Done:
    def wait(self) -> None:
        pass


_DONE = _Done()


class GradientSync:
    """Owns the gradient buffers' life cycle across micro-batches.

    flats: the replication groups (e.g. [dense, experts]); build them first (their hooks put each
           gradient into the buffer, and must run before this one's). Flats on one process group
           (a bf16 and an fp32 one over dp) reduce one after another, in list order.
    divisor: gradients are summed over the group then divided by this (the dense dp size:
             the loss is a mean over all data-parallel ranks, also for expert gradients).
    """

    def __init__(self, flats: list[FlatParams], divisor: int, overlap: bool = True):
        refuse_shared_parameters(flats, "GradientSync")
        if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
            raise ValueError(f"GradientSync: divisor={divisor!r} must be a positive integer (the dense dp size)")
        self.flats = flats
        self.divisor = divisor
        self.overlap = overlap
        self.final = False
        self.reductions = 0  # collectives launched for gradients (for tests and metrics)
        self._next = [0] * len(flats)  # per flat: index of its next bucket to launch
        # Flats on one process group (e.g. a bf16 and an fp32 FlatParams over dp) launch as one sequence, in list
        # order: collectives on a group pair by their order, whichever flat they come from, so a flat held back by
        # an unused parameter on one rank must hold the later flats of its group too.
        self._earlier = [[j for j in range(i) if flats[j].group is flat.group] for i, flat in enumerate(flats)]
        self._hooks = []
        if overlap:
            for i, flat in enumerate(flats):
                for slot in flat.slots:
                    self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._make_hook(i, slot)))
        self._arm()

    def _make_hook(self, flat_index: int, slot: ParamSlot):  # noqa: ANN202
        # weakly held, by indices: a strong reference from the parameter's C++ hook to this object (or a slot, which
        # holds the parameter) is a cycle the garbage collector cannot see, which would keep the flats' buffers and
        # process groups alive for good (see FlatParams._make_hook)
        sync_ref = weakref.ref(self)
        index = slot.index

        def hook(param: torch.Tensor) -> None:
            sync = sync_ref()
            if sync is None or not sync.final:
                return
            flat = sync.flats[flat_index]
            slot = flat.slots[index]
            bucket = flat.buckets[slot.bucket]
            if slot.arrived:  # a second gradient in the last backward phase (two backward() calls, reentrant checkpoints)
                if bucket.handle is not None:
                    raise RuntimeError(
                        f"GradientSync: {slot.name!r} received another gradient after its bucket's reduction was "
                        "launched, so that gradient would be left out of the reduction; expected one backward() per "
                        "micro-batch after begin_backward(final=True) (sum the losses first), or overlap=False"
                    )
                return  # its bucket waits: the gradient is still in the buffer when the bucket is reduced
            slot.arrived = True
            bucket.pending -= 1
            if bucket.pending == 0:
                sync._launch_ready(flat_index)

        return hook

    def begin_backward(self, final: bool) -> None:
        """Call before each micro-batch's backward; final=True on the last of the optimizer step."""
        # Refused the same way on every rank (they make the same calls): after the last micro-batch's backward its
        # buckets may already be reducing, and after finish() the reduced gradients await step(); another micro-batch
        # would be dropped from the reduction, counted twice (an all-reduce runs in place) or added to reduced ones.
        if self.final:
            raise RuntimeError(
                f"GradientSync.begin_backward(final={final!r}) after begin_backward(final=True) without finish(): the "
                "last micro-batch's reductions may already be launched; expected final=False for every micro-batch "
                "but the last, final=True once, then finish() (or zero_grads() to abandon the step)"
            )
        self._refuse_stepped(f"begin_backward(final={final!r})")
        reduced = [i for i, flat in enumerate(self.flats) if flat.reduced]
        if reduced:
            raise RuntimeError(
                f"GradientSync.begin_backward(final={final!r}): the gradients of flats{reduced} were reduced by "
                "finish() and not yet used; expected the optimizer step (or zero_grads()) before the next "
                "micro-batch's backward"
            )
        for flat in self.flats:  # before autograd meets a parameter reshaped or rebound since FlatParams was built
            flat.require_in_buffer()
            flat.take_set_grads()
        self.final = final
        if final:
            self._arm()

    def _refuse_stepped(self, call: str) -> None:
        stepped = [i for i, flat in enumerate(self.flats) if flat.stepped]
        if stepped:  # the buffers still hold the last step's gradients and "received" flags (model.zero_grad() alone
            # clears neither): a parameter unused in this step would be updated with its old gradient, and every
            # other one with the sum of both steps' gradients
            raise RuntimeError(
                f"GradientSync.{call}: the gradients of flats{stepped} were used by the last optimizer step and not "
                "cleared; expected sync.zero_grads() after opt.step() (model.zero_grad() does not clear the flat "
                "buffers)"
            )

    def _arm(self) -> None:
        for flat in self.flats:
            for bucket in flat.buckets:
                bucket.pending = len(bucket.slots)
                bucket.handle = None
            for slot in flat.slots:
                slot.arrived = False
        self._next = [0] * len(self.flats)

    def _launch_ready(self, flat_index: int) -> None:
        """Launch the flat's complete buckets from the next one in bucket order, stopping at the first incomplete one."""
        if any(self._next[j] < len(self.flats[j].buckets) for j in self._earlier[flat_index]):
            return  # an earlier flat on this group has buckets to launch first
        flat, at = self.flats[flat_index], self._next[flat_index]
        while at < len(flat.buckets) and flat.buckets[at].pending == 0:
            self._launch(flat, flat.buckets[at])
            at += 1
        self._next[flat_index] = at
        if at == len(flat.buckets):  # later flats of this group may have been waiting for this one
            for later, earlier in enumerate(self._earlier):
                if flat_index in earlier:
                    self._launch_ready(later)

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
        """After the last backward: reduce every bucket not yet launched (in bucket order), wait, and average.

        A gradient this rank did not produce in the last backward is whatever the earlier
        micro-batches accumulated, or zeros. Once per optimizer step: a second finish() before the
        step (or zero_grads()) is refused, since it would reduce the reduced gradients again.
        """
        # finish() without begin_backward() (one micro-batch, no overlap) meets the same guard: without it the
        # buffers summed every step's gradients since the last zero_grads() (review helper 173)
        self._refuse_stepped("finish()")
        again = [i for i, flat in enumerate(self.flats) if flat.reduced]
        if again:  # the same on every rank: each calls finish() and step() the same number of times
            raise RuntimeError(
                f"GradientSync.finish(): the gradients of flats{again} were already reduced for this step; expected "
                "one finish() after the last micro-batch's backward, then the optimizer step (or zero_grads()) "
                "(a second reduction would sum the group's gradients again)"
            )
        for i, flat in enumerate(self.flats):
            for bucket in flat.buckets[self._next[i] :]:
                flat.take_set_grads(bucket.slots)  # a .grad set since of a parameter the last backward did not reach
                self._launch(flat, bucket)
            self._next[i] = len(flat.buckets)
        for flat in self.flats:
            for bucket in flat.buckets:
                bucket.handle.wait()
                bucket.handle = None
                if self.divisor != 1:
                    bucket.grad_shard.div_(self.divisor)
            flat.reduced = True
        self.final = False
        self._arm()

    def zero_grads(self) -> None:
        """Zero every gradient buffer. Also abandons a step begun with begin_backward(final=True) and never
        finished (a backward that raised, a skipped micro-batch): reductions it launched are waited for, on
        every rank alike, and their result dropped, so the next begin_backward starts a fresh step."""
        for flat in self.flats:
            for bucket in flat.buckets:
                if bucket.handle is not None:
                    bucket.handle.wait()
        self.final = False
        self._arm()
        for flat in self.flats:
            flat.zero_grads()

    def remove_hooks(self) -> None:
        """At the end of training: removes these hooks and the flats' own."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for flat in self.flats:
            flat.remove_hooks()
