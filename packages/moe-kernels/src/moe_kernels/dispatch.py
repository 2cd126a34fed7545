"""Token dispatch: moves (token, slot) rows to the experts that own them and back.

A dispatcher is the seam between the MoE block and a transport. `LocalDispatcher` keeps
every expert on this device; the all-to-all dispatcher lives in `moe_kernels.all_to_all`, and
other transports (row-wise NVSHMEM) implement the same two calls.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from moe_kernels.permute import combine, permute
from moe_kernels.route_map import RouteMap, positive_int, require_route_map


class PayloadCodec(Protocol):
    """Hook to change what travels in dispatch (e.g. MXFP8 rows). Identity by default.

    encode: rows [N, d] in expert order -> the payload that travels: one tensor whose dim 0 is
    the N rows (any dtype and trailing shape, e.g. uint8 rows with their scales packed beside
    them), the same width and dtype on every rank. decode runs on the received rows and returns
    what the experts compute on. Gradients reach x only through what autograd can follow in
    encode and decode (a lossy cast is fine). An integer payload (a uint8 bit pattern) cannot carry a gradient
    at all, whatever autograd Function makes it: it is refused while x requires grad. A floating-point payload
    can (e.g. a straight-through Function whose values are rounded), but autograd hands its gradient back in the
    payload's dtype, so the backward exchange of an fp8 payload carries fp8 gradients.
    """

    def encode(self, rows: torch.Tensor) -> Any: ...

    def decode(self, payload: Any) -> torch.Tensor: ...


class IdentityCodec:
    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return payload


def checked_codec(codec: Any) -> PayloadCodec:
    """The dispatcher's codec (IdentityCodec for None), refused at construction unless it has encode and
    decode methods: a string such as "bf16" failed only at the first dispatch, inside str.encode."""
    if codec is None:
        return IdentityCodec()
    if not all(callable(getattr(codec, name, None)) for name in ("encode", "decode")):
        raise TypeError(
            f"codec must be a PayloadCodec (an object with encode(rows) and decode(payload) methods), got {codec!r:.80}"
        )
    return codec


@dataclass
class DispatchResult:
    """Rows for this rank's local experts, in local-expert order.

    rows:     [N_local, d]
    offsets:  [E_local] int32 cumulative row ends over the local experts
    context:  whatever the transport needs to send the rows back
    dropped:  0-dim int tensor: rows dropped by a capacity limit (0 when dropless)
    """

    rows: torch.Tensor
    offsets: torch.Tensor
    context: Any
    dropped: torch.Tensor


@runtime_checkable
class TokenDispatcher(Protocol):
    """What a transport implements. With more than one rank, dispatch and combine are collective
    over the transport's group: every rank calls them in the same order. A transport checks its
    inputs before its first collective and, when one rank's input is bad, makes every rank raise
    (a rank that raises alone leaves the others waiting in a collective until the timeout)."""

    num_local_experts: int

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult: ...

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor: ...


def check_payload_rows(payload: Any, num_rows: int) -> None:
    """What codec.encode returned: one tensor whose dim 0 is the T*k rows (anything else cannot travel)."""
    if not isinstance(payload, torch.Tensor) or payload.dim() < 1 or payload.shape[0] != num_rows:
        got = tuple(payload.shape) if isinstance(payload, torch.Tensor) else type(payload).__name__
        raise ValueError(f"codec.encode must return a tensor of T*k={num_rows} rows, got {got}")


def check_decoded_rows(decoded: Any, num_rows: int, d: int, rows_name: str = "T*k") -> None:
    """What codec.decode returned: the [num_rows, d] rows the experts compute on (T*k of them locally; the
    received N_recv after an exchange), d being x's width: rows of another width reached the experts' GEMM."""
    if (not isinstance(decoded, torch.Tensor) or decoded.dim() != 2 or decoded.shape[0] != num_rows
            or decoded.shape[1] != d):
        got = tuple(decoded.shape) if isinstance(decoded, torch.Tensor) else type(decoded).__name__
        raise ValueError(
            f"codec.decode must return the [{rows_name}={num_rows}, d] rows the experts compute on (d={d}, x's width), "
            f"got {got}"
        )


def require_graph_kept(rows: torch.Tensor, coded: torch.Tensor, step: str) -> None:
    """`coded` (what the codec made of `rows`) stays on autograd's graph when `rows` is on it: a codec
    that cuts it would silently leave x without the experts' gradient (under no_grad or inference_mode
    nothing is recorded, and anything goes). Requiring grad is not enough: `(rows / s).round().detach() * s`
    with a learnable s requires grad through s alone, so the graph behind `coded` must reach `rows`."""
    if not (torch.is_grad_enabled() and rows.requires_grad):
        return
    if not coded.requires_grad:
        raise ValueError(
            f"{step} does not require grad though x does: the codec cut the autograd graph, so x would get "
            "no gradient from the experts; expected a codec autograd can follow (a floating-point payload: an "
            "integer bit pattern cannot carry gradients through this dispatcher), or x.detach() for no gradient"
        )
    if not torch.compiler.is_compiling() and not _graph_reaches(coded, rows):  # a traced graph has no nodes to walk
        raise ValueError(
            f"{step} requires grad, but not through the rows: its autograd graph does not reach them (a detach() "
            "inside the codec, with a learnable parameter after it), so x would get no gradient from the experts; "
            "expected a codec whose output autograd can follow back to its input (a straight-through estimator "
            "writes rows + (quantised - rows).detach()), or x.detach() for no gradient"
        )


def _graph_reaches(coded: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether `rows`' node is among the autograd nodes behind `coded` (breadth first: a codec's few ops come
    before any graph behind its own parameters)."""
    if coded is rows:  # an identity codec
        return True
    target = rows.grad_fn
    queue, seen = collections.deque([coded.grad_fn]), set()
    while queue:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        if node is target or (target is None and getattr(node, "variable", None) is rows):  # rows a leaf
            return True
        seen.add(node)
        queue.extend(child for child, _ in node.next_functions)
    return False


class LocalDispatcher:
    """All experts on this device: dispatch is a permute, combine is the weighted sum."""

    def __init__(self, num_experts: int, codec: PayloadCodec | None = None):
        self.num_local_experts = positive_int("num_experts", num_experts)
        self.codec = checked_codec(codec)

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        require_route_map(route_map)
        if route_map.num_experts != self.num_local_experts:
            raise ValueError(
                f"route map has {route_map.num_experts} experts, dispatcher holds {self.num_local_experts}"
            )
        rows = permute(x, route_map)
        payload = self.codec.encode(rows)
        check_payload_rows(payload, route_map.num_rows)
        require_graph_kept(rows, payload, "codec.encode(rows)")  # as AllToAllDispatcher: decode's own parameters
        decoded = self.codec.decode(payload)                     # must not hide a payload cut off from x
        check_decoded_rows(decoded, route_map.num_rows, x.shape[1])
        require_graph_kept(rows, decoded, "codec.decode(codec.encode(rows))")
        return DispatchResult(decoded, route_map.offsets, route_map, torch.zeros((), dtype=torch.int64, device=x.device))

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        context = getattr(result, "context", None)  # a result of another kind may have none
        if not isinstance(context, RouteMap):
            raise ValueError(
                f"result.context is a {type(context).__name__}: pass the DispatchResult of this dispatcher's dispatch"
            )
        return combine(expert_out, context, weights)
