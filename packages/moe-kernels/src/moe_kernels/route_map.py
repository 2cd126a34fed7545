"""Routing metadata built on the device from top-k expert ids, with no host synchronisation.

Flat index convention: the (token t, slot s) pair of a [T, k] routing is flat row t*k + s.
"Sorted" rows are those flat rows grouped by expert (stable within an expert).
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch

from moe_kernels.triton import use_triton


@dataclass(frozen=True, eq=False)  # compared by identity: == on the tensor fields raised "Boolean value ... ambiguous"
class RouteMap:
    """Where every (token, slot) row goes and how many rows each expert gets.

    num_tokens, top_k, num_experts: plain ints known on the host (shapes, not data).
    counts:     [E] int32 rows per expert.
    offsets:    [E] int32 cumulative row ends (the `offs` of torch's grouped_mm).
    sort_order: [T*k] int64 flat (token, slot) index of each expert-sorted row.
    dest_row:   [T*k] int64 expert-sorted row of each flat (token, slot) index (inverse of sort_order).
    """

    num_tokens: int
    top_k: int
    num_experts: int
    counts: torch.Tensor
    offsets: torch.Tensor
    sort_order: torch.Tensor
    dest_row: torch.Tensor

    def __post_init__(self):
        """A map built by hand (another dispatcher) is held to the types, shapes, integer dtypes and
        single device build_route_map gives (metadata only, no host read: `validate()` checks the
        values), and its tensors are made contiguous: the kernels index them as flat arrays."""
        for name in ("num_tokens", "top_k", "num_experts"):
            object.__setattr__(self, name, _host_int(f"RouteMap.{name}", getattr(self, name)))
        for name in _TENSOR_FIELDS:
            require_tensor(f"RouteMap.{name}", getattr(self, name), "(a 1-D integer tensor)")
        if self.top_k < 1 or self.num_experts < 1 or self.num_tokens < 0:
            raise ValueError(
                f"RouteMap(num_tokens={self.num_tokens}, top_k={self.top_k}, num_experts={self.num_experts}): "
                "expected num_tokens >= 0, top_k >= 1 and num_experts >= 1"
            )
        rows, e = self.num_tokens * self.top_k, self.num_experts
        for name, want in (("counts", (e,)), ("offsets", (e,)), ("sort_order", (rows,)), ("dest_row", (rows,))):
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise ValueError(f"RouteMap.{name} has shape {got}, expected {want} (T={self.num_tokens}, k={self.top_k}, E={e})")
        devices = {name: getattr(self, name).device for name in _TENSOR_FIELDS}
        if len(set(devices.values())) > 1:
            raise ValueError(f"RouteMap tensors are on different devices ({_listed(devices)}): put them on one")
        for name in _INDEX_FIELDS:  # (float counts are refused where they are read: validate(), the EP dispatcher)
            _require_integer(f"RouteMap.{name}", getattr(self, name))
        for name in _TENSOR_FIELDS:
            object.__setattr__(self, name, getattr(self, name).contiguous())  # a no-op when already contiguous
        for name in ("sort_order", "dest_row"):  # the row kernels multiply them by a row stride in their own dtype:
            t = getattr(self, name)  # int32 would wrap past 2**31 elements (a hand-built map's choice)
            if t.dtype != torch.int64:
                object.__setattr__(self, name, t.to(torch.int64))

    def validate(self) -> RouteMap:
        """Check the values of a map built by hand; returns the map, so `RouteMap(...).validate()`.

        counts >= 0 summing to T*k, offsets == cumsum(counts), sort_order a permutation of the
        T*k flat rows and dest_row its inverse; a ValueError names the first value that breaks one.
        Reads the map back to the host (a sync on a GPU), so it is opt-in, once per hand-built map,
        and not for inside torch.compile or a CUDA-graph capture; build_route_map's maps satisfy it.
        """
        _require_integer("RouteMap.counts", self.counts)
        counts, offsets = self.counts.long().cpu(), self.offsets.long().cpu()
        _require_all("counts", counts >= 0, counts, "expected >= 0")
        _require_all("offsets", offsets == counts.cumsum(0), offsets, f"expected cumsum(counts)={counts.cumsum(0).tolist()[:16]}")
        if int(counts.sum()) != self.num_rows:
            raise ValueError(f"RouteMap.counts sum to {int(counts.sum())}, expected T*k={self.num_rows}")
        sort_order, dest_row = self.sort_order.cpu(), self.dest_row.cpu()
        for name, t in (("sort_order", sort_order), ("dest_row", dest_row)):
            _require_all(name, (t >= 0) & (t < self.num_rows), t, f"expected a row in [0, T*k={self.num_rows})")
        _require_all("dest_row", dest_row[sort_order] == torch.arange(self.num_rows), dest_row[sort_order],
                     "expected dest_row[sort_order[r]] == r (dest_row the inverse of sort_order, a permutation)",
                     name_index="dest_row[sort_order")
        return self

    @property
    def num_rows(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def source_token(self) -> torch.Tensor:
        """[T*k] int64 token index of each expert-sorted row."""
        return torch.div(self.sort_order, self.top_k, rounding_mode="floor")

    @property
    def starts(self) -> torch.Tensor:
        """[E] int32 first row of each expert."""
        return self.offsets - self.counts

    def rank_counts(self, ep_size: int) -> torch.Tensor:
        """[ep] int32 rows destined to each expert-parallel rank (experts split contiguously)."""
        ep_size = positive_int("ep_size", ep_size)
        if self.num_experts % ep_size != 0:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep_size={ep_size}")
        return self.counts.view(ep_size, self.num_experts // ep_size).sum(dim=1, dtype=torch.int32)


_TENSOR_FIELDS = ("counts", "offsets", "sort_order", "dest_row")
_INDEX_FIELDS = ("offsets", "sort_order", "dest_row")  # what the kernels index with


def _host_int(name: str, value: Any) -> int | torch.SymInt:
    """A count known on the host as a plain int (a Python or numpy integer, or a 0-dim integer tensor)."""
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return value  # (under torch.compile a symbolic size; operator.index would specialise it to one number)
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name}={value!r} must be an integer")


def _require_integer(name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype={t.dtype}")


def _listed(named: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in named.items())


def _require_all(name: str, ok: torch.Tensor, values: torch.Tensor, expected: str, name_index: str | None = None) -> None:
    """Raise naming the first index where `ok` is False (ok, values: [n] on the host)."""
    if bool(ok.all()):
        return
    i = int((~ok).nonzero()[0])
    at = f"{name_index}[{i}]]" if name_index else f"{name}[{i}]"
    raise ValueError(f"RouteMap.{at}={int(values[i])}: {expected} ({int((~ok).sum())} bad entries in all)")


RouteMapBackend = Literal["auto", "triton", "torch", "reference"]


def require_route_map(route_map: Any) -> None:
    """The ops take the RouteMap of build_route_map, not the expert ids it is built from (a TypeError
    naming what came instead of an AttributeError deep inside)."""
    if not isinstance(route_map, RouteMap):
        raise TypeError(
            f"route_map must be a RouteMap (build_route_map(expert_ids, num_experts)), got {type(route_map).__name__}"
        )


def require_tensor(name: str, value: Any, what: str) -> None:
    """`value` is a torch.Tensor (a list or numpy array would fail later on a missing attribute), not a DTensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {what}, got {type(value).__name__}")
    refuse_dtensor(name, value)


def refuse_dtensor(name: str, value: torch.Tensor) -> None:
    """The ops compute on local tensors: torch has no DTensor rule for them (grouped_mm, the route map's scatter),
    and a DTensor failed deep inside with "got mixed torch.Tensor and DTensor", naming neither the argument nor a
    remedy that works. FSDP2 hands its layers plain tensors in forward; a DTensor here is a sharded parameter
    reached outside it. (No DTensor exists unless its module was imported: no import here, which costs ~0.5 s.)"""
    if torch.compiler.is_compiling():  # (dynamo would trace the sys.modules lookup)
        return
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(value, dtensor.DTensor):
        return
    raise TypeError(
        f"{name} is a DTensor (placements {tuple(value.placements)}, global shape {tuple(value.shape)}): moe-kernels "
        f"computes on local tensors. Pass {name}.to_local() (this rank's shard) or {name}.full_tensor(); under "
        "FSDP2's fully_shard call the layer through its forward (or a method registered with "
        "torch.distributed.fsdp.register_fsdp_forward_method), which gathers the parameters as plain tensors"
    )


def positive_int(name: str, value: Any) -> int:
    """`value` as a plain int >= 1 (a Python or numpy integer, or a 0-dim integer tensor), else a
    ValueError naming it: a float, bool or string count would fail later, deep inside a kernel."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return number


_UNSIGNED_SHELL_DTYPES = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def _check_ids_on_host(expert_ids: torch.Tensor, num_experts: int) -> None:
    # compared as int64: in the ids' own dtype num_experts wraps (uint8 ids against 256 experts compare with 0)
    bad = (expert_ids < 0) | (expert_ids.to(torch.int64) >= num_experts)
    if torch.compiler.is_compiling():  # a traced graph cannot branch on data: assert inside it instead
        torch._assert_async(~bad.any(), f"build_route_map: an expert id is outside [0, num_experts={num_experts})")
        return
    if bool(bad.any()):
        t, s = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"expert_ids[{t}, {s}]={int(expert_ids[t, s])} is outside [0, num_experts={num_experts}) "
            f"({int(bad.sum())} ids out of range in all)"
        )


def build_route_map(expert_ids: torch.Tensor, num_experts: int, backend: RouteMapBackend = "auto") -> RouteMap:
    """Build the route map from top-k expert ids.

    expert_ids: [T, k] integer, k >= 1 (T may be 0), values in [0, num_experts). Stays on its
    device; nothing is read back.
    backend: "triton" (histogram, scan and scatter kernels; deterministic), "torch"/"reference"
    (stable sort), "auto" (triton on CUDA when installed, else torch).

    Ids outside [0, num_experts) raise a ValueError naming the first one on the CPU. On a GPU they
    are checked on the device, without a host read: the triton kernels flag them and a device-side
    assert fires (torch's own index checks do the same for the torch backend). That assert ends
    the CUDA context, as any device-side assert does; rerun on the CPU to see which id it was.
    """
    require_tensor("expert_ids", expert_ids, "[T, k]")
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [T, k], got shape {tuple(expert_ids.shape)}")
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
        raise ValueError(f"expert_ids must be an integer tensor, got dtype={expert_ids.dtype}")
    num_experts = positive_int("num_experts", num_experts)
    num_tokens, top_k = expert_ids.shape
    if top_k == 0:  # every token would go nowhere; the row kernels divide rows by k
        raise ValueError(f"expert_ids has 0 columns (shape {tuple(expert_ids.shape)}): top_k must be >= 1")
    if expert_ids.dtype in _UNSIGNED_SHELL_DTYPES:  # integers, but torch has no comparisons or sort for them
        expert_ids = expert_ids.to(torch.int64)  # (a uint64 id past 2**63 wraps negative and is refused below)
    if expert_ids.device.type == "cpu":
        _check_ids_on_host(expert_ids, num_experts)
    if use_triton(backend, expert_ids):
        if torch.compiler.is_compiling():
            from moe_kernels.triton.compile_ops import route_map as route_map_tensors
        else:
            from moe_kernels.triton.route_map_kernels import route_map_tensors

        counts, offsets, sort_order, dest_row, ids_ok = route_map_tensors(expert_ids, num_experts)
        if ids_ok.is_cuda:  # on the CPU (interpreter) the host check above has run
            torch._assert_async(ids_ok, f"build_route_map: an expert id is outside [0, num_experts={num_experts})")
        return RouteMap(num_tokens, top_k, num_experts, counts, offsets, sort_order, dest_row)
    flat = expert_ids.reshape(-1).to(torch.int64)
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    _, sort_order = torch.sort(flat, stable=True)
    dest_row = torch.empty_like(sort_order)
    dest_row.scatter_(0, sort_order, torch.arange(flat.numel(), device=device, dtype=torch.int64))
    return RouteMap(
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        counts=counts,
        offsets=offsets,
        sort_order=sort_order,
        dest_row=dest_row,
    )
