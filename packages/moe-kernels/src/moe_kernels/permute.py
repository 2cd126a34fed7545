"""Permute token rows into expert order and combine them back with the router weights."""

from __future__ import annotations

from typing import Literal

import torch

from moe_kernels.route_map import RouteMap, refuse_dtensor, require_route_map, require_tensor
from moe_kernels.triton import at_own_dtype, use_triton

RowBackend = Literal["auto", "triton", "torch", "reference"]


def check_rows(name: str, t: torch.Tensor, rows: str) -> None:
    """Token or expert rows are a 2-D [rows, d] tensor: fold extra dims into the rows first."""
    require_tensor(name, t, f"[{rows}, d]")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [{rows}, d], got shape {tuple(t.shape)}")


# Expert rows compute and combine in these on every backend: torch has no silu for integer or fp8
# tensors, combine's sum of integer rows would come back truncated, and torch promotes no fp8 dtype
# (combine's fp32 sum raised "Promotion for Float8 Types is not supported")
EXPERT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_expert_out_dtype(expert_out: torch.Tensor) -> None:
    if expert_out.dtype not in EXPERT_DTYPES:
        raise ValueError(
            f"expert_out must be floating point of {', '.join(str(d) for d in EXPERT_DTYPES)} (the weighted sum "
            f"comes back in expert_out's dtype; decode integer or fp8 rows first), got dtype={expert_out.dtype}"
        )


def check_route_map_device(route_map: RouteMap, t: torch.Tensor, name: str) -> None:
    """The route map's index tensors live where the rows do (the kernels read them as device pointers)."""
    if route_map.dest_row.device != t.device:
        raise ValueError(
            f"the route map is on device={route_map.dest_row.device} but {name} is on device={t.device}: "
            "build it from expert ids on the rows' device"
        )


def check_token_rows(x: torch.Tensor, route_map: RouteMap) -> None:
    """x: the [T, d] token rows the route map was built for."""
    require_route_map(route_map)
    check_rows("x", x, "T")
    if x.shape[0] != route_map.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows but the route map was built for {route_map.num_tokens} tokens")
    check_route_map_device(route_map, x, "x")


def check_router_weights(weights: torch.Tensor, x: torch.Tensor, route_map: RouteMap) -> None:
    """weights: [T, k] floating point on x's device (any float dtype: fp32 weights with bf16 rows
    are the usual mix; the sum accumulates in fp32 or wider)."""
    if not isinstance(weights, torch.Tensor):  # formatted only to raise: under torch.compile T may be symbolic
        require_tensor("router weights", weights, f"[T={route_map.num_tokens}, k={route_map.top_k}]")
    refuse_dtensor("router weights", weights)
    if tuple(weights.shape) != (route_map.num_tokens, route_map.top_k):
        raise ValueError(
            f"weights shape {tuple(weights.shape)} != (T, k)=({route_map.num_tokens}, {route_map.top_k})"
        )
    if not weights.dtype.is_floating_point:
        raise ValueError(f"router weights must be a floating-point tensor, got dtype={weights.dtype}")
    if weights.device != x.device:
        raise ValueError(f"router weights are on device={weights.device} but the rows are on device={x.device}")


def permute(x: torch.Tensor, route_map: RouteMap, backend: RowBackend = "auto") -> torch.Tensor:
    """Gather token rows into expert order.

    x: [T, d] -> [T*k, d]; row r is x[route_map.source_token[r]].
    """
    check_token_rows(x, route_map)
    if use_triton(backend, x):
        if torch.compiler.is_compiling():
            from moe_kernels.triton.compile_ops import permute_rows

            return permute_rows(x, route_map.dest_row, route_map.top_k)
        from moe_kernels.triton.permute_kernels import PermuteFn

        return PermuteFn.apply(x, route_map.dest_row, route_map.top_k)
    # Each (token, slot) row gathered once from a [T, k, d] view of x repeated k times (an expand: no copy): the
    # backward puts every row into its own (token, slot) place and then sums the k slots in the reduction's fp32,
    # once rounded, as the triton kernels and combine do (x.index_select(0, source_token)'s backward is index_add_,
    # on CUDA atomics in the gradient's dtype: a bf16 sum over the k slots in a run-dependent order).
    token = route_map.source_token
    slot = route_map.sort_order - token * route_map.top_k
    return x.unsqueeze(1).expand(-1, route_map.top_k, -1)[token, slot]


def combine(
    expert_out: torch.Tensor, route_map: RouteMap, weights: torch.Tensor, backend: RowBackend = "auto"
) -> torch.Tensor:
    """Sum each token's k expert rows, scaled by its router weights, accumulating in fp32.

    Every backend is deterministic (the triton kernels sum each token's rows in slot order, no atomics).

    expert_out: [T*k, d] in expert order; weights: [T, k] -> [T, d] in expert_out's dtype.
    """
    require_route_map(route_map)
    check_rows("expert_out", expert_out, "T*k")
    check_expert_out_dtype(expert_out)
    if expert_out.shape[0] != route_map.num_rows:
        raise ValueError(f"expert_out has {expert_out.shape[0]} rows, expected T*k={route_map.num_rows}")
    check_router_weights(weights, expert_out, route_map)
    check_route_map_device(route_map, expert_out, "expert_out")
    if use_triton(backend, expert_out):
        if torch.compiler.is_compiling():
            from moe_kernels.triton.compile_ops import combine_rows

            return combine_rows(expert_out, route_map.dest_row, route_map.top_k, weights)
        from moe_kernels.triton.permute_kernels import CombineFn

        return CombineFn.apply(expert_out, route_map.dest_row, weights)
    d = expert_out.shape[1]
    rows = expert_out.index_select(0, route_map.dest_row).view(route_map.num_tokens, route_map.top_k, d)
    acc = torch.promote_types(expert_out.dtype, torch.float32)
    with at_own_dtype(expert_out):
        out = torch.einsum("tkd,tk->td", rows.to(acc), weights.to(acc))
    return out.to(expert_out.dtype)
