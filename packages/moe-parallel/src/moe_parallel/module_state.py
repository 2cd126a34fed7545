"""Frozen parameters and buffers made equal on every replica, as torch DDP does when it wraps a module.

FlatParams broadcasts the trainable parameters it holds; the rest of a module's state (a frozen embedding or
random projection, a BatchNorm's running statistics and its counter) is in no FlatParams, so replicas seeded
differently would keep their own and compute different functions.
"""

from __future__ import annotations

import sys
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel.buffers import collective_device, require_same_on_every_rank
from moe_parallel.expert_parallel import _experts_prefix, moe_layers
from moe_parallel.groups import ParallelGroups

_BYTE_ALIGN = 16  # every tensor starts aligned in the byte buffer, so its slice views back as any dtype


@torch.no_grad()
def broadcast_module_state(model: nn.Module, groups: ParallelGroups, exclude: Collection[str] = (), *,
                           bucket_bytes: int = 256 * 2**20) -> None:
    """Copy the first replica's frozen parameters and buffers into every rank's model, in place (collective over dp).

    Which tensors: every buffer (persistent or not; int counters, bool masks and 0-element ones included) and every
    parameter with requires_grad=False. Trainable parameters are left alone: FlatParams broadcasts them when it is
    built (broadcasting them here too would only repeat it). `exclude`: names (as model.named_parameters() /
    named_buffers() spell them) meant to differ per rank, left as they are; a name that is not a frozen parameter or
    buffer of the model is refused.
    Over which group: a tensor under a MoE layer's experts module (`<layer>.experts.`, the names
    expert_parameter_names gives, buffers included) or one that apply_expert_parallel sliced goes over groups.edp, from
    its first rank, since the ranks of one dp group hold other experts there; every other tensor goes over groups.dp,
    from its first rank. A buffer under the experts module that apply_expert_parallel left whole (it slices parameters
    only) is therefore only made equal within each edp group: keep state meant to be one for all experts outside the
    experts module, or seed it alike.
    Call on every rank of groups.dp, after the model is built and materialized, before training; before or after
    apply_expert_parallel and FlatParams alike. Every rank must pass a model with the same such names, shapes and
    dtypes (else a ValueError on every rank names the first difference); tensors on the meta device are refused, and
    so are sparse (not torch.strided) ones and DTensors (apply_fsdp shards frozen parameters: call this before it).
    Tensors travel as their bytes, so every dtype arrives bit-exact: in order, packed into buckets of at most
    `bucket_bytes` (a positive int, the same on every rank: a bad or differing value is refused on every rank), one
    broadcast per bucket, as torch DDP broadcasts its buffers in 250 MB buckets; a tensor larger than bucket_bytes
    travels alone, in place when it is contiguous (no copy), else through a copy of its own. Peak extra memory: one
    bucket (at most bucket_bytes) and the contiguous copy of one tensor in it, so at most twice bucket_bytes, or else
    one copy of the largest tensor over bucket_bytes that cannot travel in place (not contiguous, e.g. transposed or
    expanded; a conjugate view; not on the collective's device, e.g. on CPU under NCCL). A group of one rank changes
    nothing.
    """
    dense, expert, refusal = _module_state(model, exclude)
    refusal = _bucket_refusal(bucket_bytes) or refusal
    device = collective_device(groups.dp)
    entries = ([f"bucket_bytes={bucket_bytes!r}"]  # the buckets, so the broadcasts, must match on every rank
               + [f"{name!r} {_describe(t)} over dp" for name, t in dense]
               + [f"{name!r} {_describe(t)} over edp" for name, t in expert])
    what = "broadcast_module_state: the frozen parameters and buffers"
    # One check over dp covers both: edp is a subset of dp, and each rank's expert slices have the same shapes.
    # A bad bucket_bytes travels as this rank's refusal: raised on every rank, with no broadcast begun (no hang).
    require_same_on_every_rank(groups.dp, entries, what, device, refusal,
                               expected="every rank of the group to build the same model (same frozen parameter and "
                                        "buffer names, shapes and dtypes, in the same order) and pass the same "
                                        "bucket_bytes")
    _broadcast([t for _, t in dense], groups.dp, bucket_bytes)
    _broadcast([t for _, t in expert], groups.edp, bucket_bytes)


def _bucket_refusal(bucket_bytes: object) -> ValueError | None:
    if isinstance(bucket_bytes, int) and not isinstance(bucket_bytes, bool) and bucket_bytes > 0:
        return None
    return ValueError(f"broadcast_module_state: bucket_bytes={bucket_bytes!r} is not a positive int; expected the most "
                      "bytes one broadcast carries, e.g. 256 * 2**20 (the default)")


def _module_state(model: nn.Module, exclude: Collection[str]) -> tuple[list, list, ValueError | None]:
    """(name, tensor) of the frozen parameters and buffers, dense and expert-sliced, and this rank's refusal if any."""
    if isinstance(exclude, str):  # set("running_mean") would be its letters
        return [], [], ValueError(f"broadcast_module_state: exclude={exclude!r} is a str; expected a collection of "
                                  f"names, e.g. [{exclude!r}]")
    try:
        exclude = set(exclude)
    except TypeError as e:  # None, a number, an unhashable name: refused here so the other ranks raise too (no hang)
        return [], [], ValueError(f"broadcast_module_state: exclude={exclude!r} is not a collection of names ({e}); "
                                  "expected e.g. ['bn.running_mean'], or () for none")
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    state = [*frozen, *model.named_buffers()]
    unknown = sorted(exclude - {n for n, _ in state}, key=repr)  # key: a non-str name is refused, not a TypeError
    if unknown:
        return [], [], ValueError(
            f"broadcast_module_state: exclude names {unknown}, which are not frozen parameters or buffers of the model "
            "(trainable parameters are never broadcast here: FlatParams does it); expected names among "
            f"model.named_parameters() with requires_grad=False and model.named_buffers(), e.g. "
            f"{[n for n, _ in state][:5]}"
        )
    state = [(n, t) for n, t in state if n not in exclude]
    on_meta = [n for n, t in state if t.is_meta]
    if on_meta:
        return [], [], ValueError(
            f"broadcast_module_state got tensors on the meta device (shapes only, no data): {on_meta[:5]}"
            f"{f' and {len(on_meta) - 5} more' if len(on_meta) > 5 else ''}; expected the model materialized first "
            "(model.to_empty(device=...) and its initialisation), then broadcast_module_state"
        )
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # imported by whoever made one
    sharded = [n for n, t in state if dtensor is not None and isinstance(t, dtensor)]
    if sharded:
        return [], [], ValueError(
            f"broadcast_module_state got DTensors (sharded by apply_fsdp / fully_shard): {sharded[:5]}; each rank "
            "holds its own shard of them, which a broadcast from the first replica would overwrite; expected "
            "broadcast_module_state on the plain model, before apply_fsdp"
        )
    not_strided = [f"{n!r} ({t.layout})" for n, t in state if t.layout != torch.strided]
    if not_strided:  # sparse or another layout: its bytes are no dense block a bucket could carry
        return [], [], ValueError(
            f"broadcast_module_state got tensors whose layout is not torch.strided: {', '.join(not_strided[:5])}; "
            "expected dense (strided) frozen parameters and buffers, e.g. t.to_dense(), or their names in exclude"
        )
    prefixes = tuple(_experts_prefix(name) for name, _ in moe_layers(model))
    dense, expert = [], []
    for name, t in state:
        is_expert = name.startswith(prefixes) or getattr(t, "expert_shard", None) is not None
        (expert if is_expert else dense).append((name, t))
    return dense, expert, None


def _describe(t: torch.Tensor) -> str:
    return f"{'frozen parameter' if isinstance(t, nn.Parameter) else 'buffer'} {tuple(t.shape)} {t.dtype}"


def _broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int) -> None:
    """The tensors' bytes broadcast from the group's first rank and copied back in place: in order, consecutive ones
    packed into uint8 buckets of at most bucket_bytes (each tensor 16-byte aligned), one broadcast per bucket; one
    larger than bucket_bytes alone, in place where it can be. Every rank makes the same broadcasts of the same sizes:
    they follow from the shapes and dtypes alone, which every rank was checked to share."""
    if dist.get_world_size(group) == 1:
        return
    device = collective_device(group)
    bucket: list[tuple[torch.Tensor, int, int]] = []  # (tensor, start, size)
    end = 0  # bytes the bucket holds so far
    for t in tensors:
        size = t.numel() * t.element_size()
        if size == 0:  # a 0-element tensor: nothing to send (every rank agrees: the shapes were checked)
            continue
        start = -(-end // _BYTE_ALIGN) * _BYTE_ALIGN
        if bucket and start + size > bucket_bytes:
            _send_bucket(bucket, end, group, device)
            bucket, start = [], 0
        if size > bucket_bytes:
            _send_alone(t, group, device)
            end = 0
            continue
        bucket.append((t, start, size))
        end = start + size
    if bucket:
        _send_bucket(bucket, end, group, device)


def _send_bucket(bucket: list[tuple[torch.Tensor, int, int]], nbytes: int, group: dist.ProcessGroup,
                 device: torch.device) -> None:
    packed = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for t, start, size in bucket:
        packed[start : start + size].copy_(_bytes_of(t))
    dist.broadcast(packed, dist.get_global_rank(group, 0), group=group)
    for t, start, size in bucket:
        _write(t, packed[start : start + size].view(t.dtype).view(t.shape))


def _send_alone(t: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> None:
    """One tensor larger than a bucket: its own bytes broadcast in place where they lie in order (contiguous, on the
    collective's device, no lazy conjugate / negative bit), else a copy of them, written back."""
    src = dist.get_global_rank(group, 0)
    if t.device == device and t.is_contiguous() and not t.is_conj() and not t.is_neg() and not _expanded(t):
        dist.broadcast(t.detach().reshape(-1).view(torch.uint8), src, group=group)  # reshape: a 0-dim one too
        return
    copy = _bytes_of(t).to(device)  # a new tensor: t is not contiguous, or conjugate / negative, or elsewhere
    dist.broadcast(copy, src, group=group)
    _write(t, copy.view(t.dtype).view(t.shape))


def _expanded(t: torch.Tensor) -> bool:
    return any(t.stride(d) == 0 and t.shape[d] > 1 for d in range(t.dim()))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    # any dtype (bool, float8, complex) as its bytes; a conjugate or negative view's values, not its lazy bit's operand
    return t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def _write(t: torch.Tensor, values: torch.Tensor) -> None:
    """t.copy_(values) where an expanded t (stride 0: one element read at many places, e.g. arange(n).expand(b, n))
    is written once per element, at its first index along each expanded dim (copy_ refuses such a target)."""
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.shape[d] > 1:
            t, values = t.narrow(d, 0, 1), values.narrow(d, 0, 1)
    t.copy_(values)
