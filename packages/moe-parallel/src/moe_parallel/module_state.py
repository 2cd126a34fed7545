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
def broadcast_module_state(model: nn.Module, groups: ParallelGroups, exclude: Collection[str] = ()) -> None:
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
    so are DTensors (apply_fsdp shards frozen parameters: call this before it). The bytes of each group's tensors
    travel in one broadcast, so every dtype arrives bit-exact (peak memory: that state twice). A group of one rank
    changes nothing.
    """
    dense, expert, refusal = _module_state(model, exclude)
    device = collective_device(groups.dp)
    entries = ([f"{name!r} {_describe(t)} over dp" for name, t in dense]
               + [f"{name!r} {_describe(t)} over edp" for name, t in expert])
    what = "broadcast_module_state: the frozen parameters and buffers"
    # One check over dp covers both: edp is a subset of dp, and each rank's expert slices have the same shapes.
    require_same_on_every_rank(groups.dp, entries, what, device, refusal,
                               expected="every rank of the group to build the same model (same frozen parameter and "
                                        "buffer names, shapes and dtypes, in the same order)")
    _broadcast([t for _, t in dense], groups.dp)
    _broadcast([t for _, t in expert], groups.edp)


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
            f"broadcast_module_state got DTensors (sharded by apply_fsdp / fully_shard): {sharded[:5]}; each rank holds "
            "its own shard of them, which a broadcast from the first replica would overwrite; expected "
            "broadcast_module_state on the plain model, before apply_fsdp"
        )
    prefixes = tuple(_experts_prefix(name) for name, _ in moe_layers(model))
    dense, expert = [], []
    for name, t in state:
        is_expert = name.startswith(prefixes) or getattr(t, "expert_shard", None) is not None
        (expert if is_expert else dense).append((name, t))
    return dense, expert, None


def _describe(t: torch.Tensor) -> str:
    return f"{'frozen parameter' if isinstance(t, nn.Parameter) else 'buffer'} {tuple(t.shape)} {t.dtype}"


def _broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """The tensors' bytes packed into one uint8 buffer, broadcast from the group's first rank, copied back in place."""
    if dist.get_world_size(group) == 1:
        return
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts, cursor = [], 0
    for size in sizes:
        starts.append(cursor)
        cursor += -(-size // _BYTE_ALIGN) * _BYTE_ALIGN
    if cursor == 0:  # nothing but 0-element tensors (every rank agrees: the shapes were checked)
        return
    packed = torch.empty(cursor, dtype=torch.uint8, device=collective_device(group))
    for t, start, size in zip(tensors, starts, sizes):
        if size:
            packed[start : start + size].copy_(_bytes_of(t))
    dist.broadcast(packed, dist.get_global_rank(group, 0), group=group)
    for t, start, size in zip(tensors, starts, sizes):
        if size:
            _write(t, packed[start : start + size].view(t.dtype).view(t.shape))


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
