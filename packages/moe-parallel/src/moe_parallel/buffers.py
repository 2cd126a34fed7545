"""Flat parameter and gradient buffers split into buckets, each bucket sharded over a group.

Every parameter of one replication group (dense params over dense DP, expert params over
expert DP) becomes a view into one flat parameter buffer, and its gradient a view into one
flat gradient buffer, so a bucket is reduced with a single collective and the model weights
are refreshed with a single all-gather per bucket. Bucket b of size n (a multiple of the
group size g) is owned in g equal shards: rank r owns [start + r*n/g, start + (r+1)*n/g).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Iterable
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
    shape: tuple[int, ...] = ()  # the parameter's shape when FlatParams was built
    has_grad: bool = False  # a gradient reached this parameter on this rank since the last zero_grads()
    arrived: bool = False  # GradientSync: its gradient arrived in the last backward of the step


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
    group: the process group the gradients are reduced over (and state sharded over when shard=True); None is the
    default group.
    grad_dtype: dtype of the accumulation buffer (fp32 for fp32 gradient accumulation).

    Construction is collective over `group`: every rank must pass the same names, shapes and dtype
    (else a ValueError on every rank names the first difference), and the weights are broadcast from
    the group's first rank, as torch DDP does, so the replicas start identical.

    A post-accumulate-grad hook on every parameter adds a lower-precision gradient into the fp32
    buffer and records that the parameter received a gradient (`ParamSlot.has_grad`): the
    optimizer leaves a parameter that no rank gave a gradient untouched, as torch.optim.AdamW does.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup | None,
        shard: bool,
        grad_dtype: torch.dtype | None = None,
        bucket_numel: int = 1 << 25,
    ):
        named_params = list(named_params)  # model.named_parameters() is a generator
        # None names the default group, as torch.distributed's own calls take it (dist.get_global_rank refused it)
        self.group = group = dist.group.WORLD if group is None else group
        self.group_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        try:
            _check_named_params(named_params)
            if grad_dtype is not None and not (isinstance(grad_dtype, torch.dtype) and grad_dtype.is_floating_point):
                # an int one failed at the first backward ("result type Float can't be cast"), a str in torch.zeros
                raise ValueError(f"FlatParams: grad_dtype={grad_dtype!r}, expected a floating-point torch.dtype "
                                 "(e.g. torch.float32 for fp32 gradient accumulation) or None (the parameters' dtype)")
        except ValueError as refusal:
            # The other ranks are about to meet this one in the check below: they raise too, naming this rank,
            # instead of waiting in that collective for a rank that has left (a hang, or gloo's "connection closed").
            require_same_on_every_rank(group, [], "FlatParams: the parameters", collective_device(group), refusal)
            raise
        self.shard = shard and self.group_size > 1  # a group of one keeps the whole bucket
        self.param_dtype = named_params[0][1].dtype
        self.grad_dtype = grad_dtype or self.param_dtype
        device = named_params[0][1].device
        shards = self.group_size if self.shard else 1
        require_same_on_every_rank(
            group, [f"FlatParams(shard={shard}, grad_dtype={self.grad_dtype}, bucket_numel={bucket_numel})"]
            + [f"{n!r} {tuple(p.shape)} {p.dtype}{_expert_rows(p)}" for n, p in named_params],
            "FlatParams: the parameters", device,
        )
        self.reduced = False  # GradientSync.finish() reduced the gradients; cleared by zero_grads() and the optimizer step
        self.stepped = False  # an optimizer step used the gradients, which zero_grads() has not cleared since
        self.slots: list[ParamSlot] = []
        self.buckets: list[Bucket] = []
        # Reverse order: gradients become ready roughly last layer first.
        cursor, bucket_start = 0, 0
        for name, p in reversed(named_params):
            if cursor > bucket_start and cursor + p.numel() - bucket_start > bucket_numel:
                bucket_start = cursor = self._close_bucket(bucket_start, cursor, shards)
            self.slots.append(ParamSlot(name, p, cursor, p.numel(), len(self.buckets), len(self.slots), tuple(p.shape)))
            cursor = _round_up(cursor + p.numel(), ALIGN)
        total = self._close_bucket(bucket_start, cursor, shards)

        self.param_buffer = torch.zeros(total, dtype=self.param_dtype, device=device)
        self.grad_buffer = torch.zeros(total, dtype=self.grad_dtype, device=device)
        for slot in self.slots:
            self.buckets[slot.bucket].slots.append(slot)
            view = self.param_view(slot)
            view.copy_(slot.param.detach())
            slot.param.data = view
            slot.param.in_flat_params = True  # apply_expert_parallel refuses to replace it afterwards
        if self.group_size > 1:  # replicas start identical (a rank seeded differently would otherwise diverge)
            dist.broadcast(self.param_buffer, dist.get_global_rank(group, 0), group=group)
        self.grads_bound = self.grad_dtype == self.param_dtype
        for b in self.buckets:
            b.grad_shard = (
                torch.empty(b.shard_numel, dtype=self.grad_dtype, device=device)
                if self.shard else self.grad_buffer[b.start : b.start + b.numel]
            )
        self._hooks = [slot.param.register_post_accumulate_grad_hook(self._make_hook(slot)) for slot in self.slots]
        if self.grads_bound:
            self._hooks += [slot.param.register_hook(self._make_bind_hook(slot)) for slot in self.slots if slot.numel]
        self.zero_grads()

    def _make_hook(self, slot: ParamSlot):  # noqa: ANN202
        # The hook lives in the parameter's C++ autograd state, which Python's garbage collector cannot see into: a
        # strong reference to this FlatParams (or to a slot, which holds the parameter) would make a cycle that is
        # never collected, keeping the buffers and the process group (its gloo threads) alive after the last user
        # reference is gone. So the hook holds a weak reference and indices.
        flat_ref = weakref.ref(self)
        index = slot.index
        param_ptr = self.param_buffer.data_ptr() + slot.start * self.param_buffer.element_size()
        grad_ptr = self.grad_buffer.data_ptr() + slot.start * self.grad_buffer.element_size()

        def hook(param: torch.Tensor) -> None:
            flat = flat_ref()
            if flat is None:  # the FlatParams is gone: its gradients have no buffer to reach
                return
            slot = flat.slots[index]
            if slot.numel and param.data_ptr() != param_ptr:
                raise RuntimeError(
                    f"{slot.name!r} no longer lives in the FlatParams buffer that the optimizer updates (model.to(), "
                    ".half(), or param.data = ... after FlatParams was built); expected the model cast and moved first, "
                    "then FlatParams"
                )
            if not flat.grads_bound:  # fp32 accumulation of a lower-precision gradient
                flat.add_grad_into_buffer(slot)
            elif slot.numel and param.grad.data_ptr() != grad_ptr:
                # autograd replaced the bound view out of place (backward(create_graph=True) sums view + new into a
                # new tensor): the bind hook had .grad bound to the view before the accumulation, so the new tensor
                # holds the view's gradient too, and is copied over it (added, the earlier micro-batches counted twice)
                view = flat.grad_view(slot)
                with torch.no_grad():  # create_graph runs the hook in grad mode: the buffer stays out of the graph
                    view.copy_(param.grad)
                param.grad = view
            slot.has_grad = True

        return hook

    def _make_bind_hook(self, slot: ParamSlot):  # noqa: ANN202
        """A hook on the gradient before autograd accumulates it (same-dtype case): .grad bound to the buffer view.
        .grad set to None since (model.zero_grad(), torch's default set_to_none): the view, keeping what the step's
        earlier micro-batches left there, as the separate fp32 buffer keeps them (QA 136). A tensor set as .grad
        (p.grad = p.grad * mask): copied into the view first, so it is the gradient so far, as with torch."""
        flat_ref = weakref.ref(self)  # weak, as _make_hook's
        index = slot.index

        def bind(grad: torch.Tensor) -> None:
            flat = flat_ref()
            if flat is not None:
                flat.take_set_grads([flat.slots[index]])

        return bind

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
        return self.param_buffer[slot.start : slot.start + slot.numel].view(slot.shape)

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        return self.grad_buffer[slot.start : slot.start + slot.numel].view(slot.shape)

    def bind_grads(self) -> None:
        """Point each .grad at its buffer view, so autograd accumulates in place (same-dtype case)."""
        if self.grads_bound:
            for slot in self.slots:
                slot.param.grad = self.grad_view(slot)

    def take_set_grads(self, slots: list[ParamSlot] | None = None) -> None:
        """A .grad set since, taken into the buffer. Run before a micro-batch's backward and by finish() for the
        buckets it launches (a parameter the last backward did not reach, whose hooks never ran).
        Bound mode (grad_dtype the weights'): None (model.zero_grad()) keeps the buffer's gradient so far, a tensor
        (p.grad = p.grad * mask, or one assigned by hand) replaces it; the view is bound again.
        Another grad_dtype: a backward leaves .grad None (its hook adds the gradient into the buffer), so a tensor
        found there was set by hand: it is added into the buffer as a backward's gradient is, and .grad set to None.
        A tensor taken counts as a gradient received (the optimizer updates the parameter), as torch.optim.AdamW
        updates any parameter with a .grad (before moe-parallel 0.13.9 it was left out: bound, the norm counted it
        and the update skipped the parameter; unbound, it never reached the buffer)."""
        base, size = self.grad_buffer.data_ptr(), self.grad_buffer.element_size()
        for slot in self.slots if slots is None else slots:
            p = slot.param
            if not self.grads_bound:
                if p.grad is not None:
                    self.add_grad_into_buffer(slot)
                    slot.has_grad = True
            elif slot.numel and (p.grad is None or p.grad.data_ptr() != base + slot.start * size):
                view = self.grad_view(slot)
                if p.grad is not None:
                    with torch.no_grad():
                        view.copy_(p.grad)
                    slot.has_grad = True
                p.grad = view

    def add_grad_into_buffer(self, slot: ParamSlot) -> None:
        """Another grad_dtype: the parameter's .grad added into its buffer view, then set to None (the buffer holds the
        sum so far). Outside autograd: create_graph runs the hooks in grad mode; the buffer stays out of the graph."""
        with torch.no_grad():
            self.grad_view(slot).add_(slot.param.grad)
        slot.param.grad = None

    def require_in_buffer(self) -> None:
        """Raise naming the first parameter whose data is no longer its view of the flat buffer (rebound, reshaped or
        cast after FlatParams was built): its gradient could not reach the buffer (autograd fails to add one of another
        shape to the bound .grad, naming no parameter), nor the optimizer's update its weights."""
        base, size = self.param_buffer.data_ptr(), self.param_buffer.element_size()
        for slot in self.slots:
            p = slot.param
            if (p.shape != slot.shape or p.dtype != self.param_dtype
                    or (slot.numel and p.data_ptr() != base + slot.start * size)):
                raise RuntimeError(
                    f"{slot.name!r} no longer lives in the FlatParams buffer that the optimizer updates: it is now "
                    f"{tuple(p.shape)} {p.dtype} on {p.device}, built as {slot.shape} {self.param_dtype} in that buffer "
                    "(model.to(), .half(), or param.data = ... after FlatParams was built); expected the model cast, "
                    "moved and shaped first, then FlatParams"
                )

    def zero_grads(self) -> None:
        self.require_in_buffer()  # binding .grad views of the built shapes would fail with a bare view error
        self.grad_buffer.zero_()
        self.reduced = False
        self.stepped = False
        for slot in self.slots:
            slot.has_grad = False
            if not self.grads_bound:  # a .grad from before FlatParams was built would be added into the next step
                slot.param.grad = None
        self.bind_grads()


def _check_named_params(named_params: list) -> None:
    """The checks one rank makes alone: (name, parameter) pairs, at least one, one dtype, none frozen, none twice."""
    for i, entry in enumerate(named_params):
        # a bare tensor (model.parameters()) would be unpacked along its first dim: two rows pass as a pair
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], torch.Tensor)):
            raise ValueError(
                f"FlatParams: named_params[{i}] is a {type(entry).__name__}, expected a (name, parameter) pair "
                "(pass model.named_parameters(), not model.parameters())"
            )
    if not named_params:
        raise ValueError("FlatParams needs at least one parameter")
    dtypes = {p.dtype for _, p in named_params}
    if len(dtypes) != 1:
        raise ValueError(f"parameters of one group must share a dtype, got {sorted(map(str, dtypes))}")
    # a model built on the meta device and not materialized failed in the weight copy with torch's bare "Cannot copy
    # out of meta tensor; no data!" (naming no parameter; the other ranks then met gloo's "Connection closed by peer")
    on_meta = [n for n, p in named_params if p.is_meta]
    if on_meta:
        raise ValueError(
            f"FlatParams got parameters on the meta device (shapes only, no data): {on_meta[:5]}"
            f"{f' and {len(on_meta) - 5} more' if len(on_meta) > 5 else ''}; expected the model materialized first "
            "(model.to_empty(device=...) and its initialisation), then FlatParams"
        )
    devices = {p.device for _, p in named_params}
    if len(devices) != 1:  # the flat buffer lives on the first one's device: the others were silently copied there
        raise ValueError(f"parameters of one group must share a device, got {sorted(map(str, devices))}; expected "
                         "the model moved to one device first, then FlatParams")
    frozen = [n for n, p in named_params if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"FlatParams got parameters with requires_grad=False: {frozen}; leave frozen parameters out "
            "(e.g. [(n, p) for n, p in model.named_parameters() if p.requires_grad]): they never get a "
            "gradient, and the optimizer must not update them"
        )
    _refuse_repeats(named_params)


def _expert_rows(p: nn.Parameter) -> str:
    """Which experts an expert-parallel slice holds (apply_expert_parallel marks it): ranks of one FlatParams must hold
    the same ones, else the broadcast overwrites other experts' weights and unrelated experts' gradients are summed."""
    shard = getattr(p, "expert_shard", None)
    if shard is None:
        return ""
    return (f" experts [{shard.row_offset}, {shard.row_offset + p.shape[0]}) of {shard.global_shape[0]} (an "
            "expert-parallel slice: its FlatParams goes over groups.edp, the ranks that hold the same experts)")


def _refuse_repeats(named_params: list[tuple[str, nn.Parameter]]) -> None:
    """One parameter twice (its gradient would count twice) or one name twice (step counts and checkpoints key on it)."""
    names: dict[str, int] = {}
    params: dict[int, str] = {}
    for name, p in named_params:
        if name in names:
            raise ValueError(f"FlatParams got the name {name!r} twice: expected one entry per parameter name")
        if id(p) in params:
            raise ValueError(f"FlatParams got one parameter twice, as {params[id(p)]!r} and {name!r}: "
                             "expected each parameter once (model.named_parameters() lists a shared one once)")
        names[name], params[id(p)] = 0, name


def refuse_shared_parameters(flats: list[FlatParams], owner: str) -> None:
    """A parameter (or name) in two FlatParams would be updated twice and its gradient counted twice."""
    if not flats:
        raise ValueError(f"{owner} needs at least one FlatParams, got none")
    seen: dict[int, tuple[int, str]] = {}
    names: dict[str, int] = {}
    for i, flat in enumerate(flats):
        for slot in flat.slots:
            if id(slot.param) in seen:
                j, other = seen[id(slot.param)]
                raise ValueError(f"{owner}: the parameter {slot.name!r} of flats[{i}] is also {other!r} of flats[{j}]; "
                                 "expected each parameter in one FlatParams (dense over dp, experts over expert-dp)")
            if slot.name in names:
                raise ValueError(f"{owner}: the name {slot.name!r} is in flats[{names[slot.name]}] and flats[{i}]; "
                                 "expected each parameter name in one FlatParams")
            seen[id(slot.param)], names[slot.name] = (i, slot.name), i


_SAME_MODEL = ("every rank of the group to build the same model (same parameter names, shapes and dtype, in the "
               "same order)")


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small check's tensors go when a rank has no parameter to take the device from: the GPU for NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_same_on_every_rank(group: dist.ProcessGroup, entries: list[str], what: str, device: torch.device,
                               refusal: Exception | None = None, expected: str = _SAME_MODEL) -> None:
    """Raise on every rank of `group` unless every rank passed the same entries and none brought a refusal.

    One all-gather of a 16-byte digest and two counts; only when they differ, or a rank refuses, the
    entries themselves travel (as bytes), to name the first one that differs. Without this, ranks holding
    other shapes pair unrelated elements in the gradient reduction (silently, when the sizes happen to
    match) or abort inside gloo / NCCL.
    refusal: this rank's own error from a check it made alone (a frozen parameter, mixed dtypes): raised
    here after the exchange, while the other ranks raise a ValueError naming this rank and its message,
    instead of waiting in the collective for a rank that never reaches it.
    expected: what the message asks for when the entries differ.
    """
    size = dist.get_world_size(group)
    if size == 1:
        if refusal is not None:
            try:
                raise refusal
            finally:
                # Its traceback holds this frame: kept here, the pair is a cycle that keeps `group` (and gloo's worker
                # threads) alive after the caller dropped the error, until the garbage collector runs; a gloo group
                # alive at interpreter exit can abort the process (SIGABRT, pytorch#190489).
                del refusal
        return
    digest = hashlib.sha256("\n".join(entries).encode()).digest()
    # only read when something differs; json, not pickle: what travels is text (all_gather_object unpickles)
    details = json.dumps([None if refusal is None else f"{type(refusal).__name__}: {refusal}", entries]).encode()
    mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True), len(entries), int(refusal is not None),
                         len(details)], dtype=torch.int64, device=device)
    everyone = torch.empty(4 * size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.view(size, 4).cpu()
    if not bool(rows[:, 2].any()) and bool((rows[:, :2] == rows[0, :2]).all()):  # every rank reads the same rows
        return
    width = int(rows[:, 3].max())
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: len(details)] = torch.tensor(list(details), dtype=torch.uint8)
    gathered = torch.empty(size * width, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, padded.to(device), group=group)
    gathered = gathered.view(size, width).cpu()
    told = [json.loads(bytes(gathered[r, : int(rows[r, 3])].tolist())) for r in range(size)]
    if refusal is not None:
        try:
            raise refusal
        finally:
            del refusal  # no cycle through this frame (as above)
    ranks = dist.get_process_group_ranks(group)
    refused = next((r for r in range(size) if told[r][0] is not None), None)
    if refused is not None:
        raise ValueError(f"{what}: rank {ranks[refused]} refused them ({told[refused][0]}); every rank of the "
                         "group stops here")
    lists = [entries_of for _, entries_of in told]
    for r in range(1, size):
        a, b = lists[0], lists[r]
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise ValueError(
                f"{what} differ across ranks: rank {ranks[0]} has {a[i] if i < len(a) else '(nothing more)'} where "
                f"rank {ranks[r]} has {b[i] if i < len(b) else '(nothing more)'} ({len(a)} vs {len(b)} entries); "
                f"expected {expected}"
            )


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
