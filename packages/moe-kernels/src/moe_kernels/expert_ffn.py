"""The routed-expert SwiGLU FFN as functional ops.

`swiglu_experts` runs on rows already in expert order (after a dispatcher); `moe_ffn` is the
whole block from token rows: gather, two grouped GEMMs with SwiGLU, weighted combine. The
triton backend fuses the gather into the first GEMM's A-load and SwiGLU (forward and
backward) into GEMM epilogues; torch and reference compose the unfused ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_kernels.grouped_gemm import GemmBackend, grouped_gemm
from moe_kernels.permute import combine, permute
from moe_kernels.route_map import RouteMap
from moe_kernels.triton import triton_runs_on


def _use_triton(backend: str, x: torch.Tensor) -> bool:
    if backend not in ("auto", "triton", "torch", "reference"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'triton', 'torch', 'reference'")
    return backend == "triton" or (backend == "auto" and triton_runs_on(x))


def _check_weights(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, offsets: torch.Tensor) -> None:
    E, d, two_h = w_gate_up.shape
    if two_h % 2 or tuple(w_down.shape) != (E, two_h // 2, d):
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} are not [E, d, 2h], [E, h, d]")
    if x.shape[-1] != d:
        raise ValueError(f"x has d={x.shape[-1]} but w_gate_up has d={d}")
    if offsets.shape != (E,):
        raise ValueError(f"offsets shape {tuple(offsets.shape)} != (num_experts,)=({E},)")


def swiglu_experts(
    x_sorted: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor,
    backend: GemmBackend = "auto",
) -> torch.Tensor:
    """Expert SwiGLU on rows already in expert order.

    x_sorted: [N, d]; w_gate_up: [E, d, 2h] (gate then up); w_down: [E, h, d]; offsets: [E] int32 -> [N, d].
    """
    if _use_triton(backend, x_sorted):
        from moe_kernels.triton.ffn_kernels import swiglu_ffn_sorted

        _check_weights(x_sorted, w_gate_up, w_down, offsets)
        return swiglu_ffn_sorted(x_sorted, w_gate_up, w_down, offsets)
    h = grouped_gemm(x_sorted, w_gate_up, offsets, backend)
    gate, up = h.chunk(2, dim=-1)
    return grouped_gemm(F.silu(gate) * up, w_down, offsets, backend)


def moe_ffn(
    x: torch.Tensor,
    route_map: RouteMap,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    backend: GemmBackend = "auto",
) -> torch.Tensor:
    """The routed-expert block on local experts: sum_s weights[t,s] * SwiGLU_{e(t,s)}(x[t]).

    x: [T, d]; weights: [T, k] router weights; w_gate_up: [E, d, 2h]; w_down: [E, h, d] -> [T, d].
    Same result as combine(swiglu_experts(permute(x, rm), ...), rm, weights); autograd flows to
    x, weights, w_gate_up and w_down.
    """
    _check_weights(x, w_gate_up, w_down, route_map.offsets)
    if x.shape[0] != route_map.num_tokens or tuple(weights.shape) != (route_map.num_tokens, route_map.top_k):
        raise ValueError(
            f"x {tuple(x.shape)} and weights {tuple(weights.shape)} do not match the route map's "
            f"T={route_map.num_tokens}, k={route_map.top_k}"
        )
    if backend == "auto":
        backend = _pick_block_backend(x, route_map, weights, w_gate_up, w_down)
    if _use_triton(backend, x):
        from moe_kernels.triton.ffn_kernels import swiglu_ffn_routed

        return swiglu_ffn_routed(x, weights, w_gate_up, w_down, route_map.offsets, route_map.sort_order, route_map.dest_row)
    # "torch": grouped_mm GEMMs between the (triton where available) permute and combine kernels
    rows_backend = "reference" if backend == "reference" else "auto"
    y = swiglu_experts(permute(x, route_map, rows_backend), w_gate_up, w_down, route_map.offsets, backend)
    return combine(y, route_map, weights, rows_backend)


_BLOCK_CHOICE: dict[tuple, str] = {}


def _pick_block_backend(x, route_map, weights, w_gate_up, w_down) -> str:
    """auto: triton (fused) or torch grouped_mm GEMMs, whichever runs the block's forward+backward
    faster on this shape, timed once per shape and cached (the fused Triton GEMM wins on small
    d and h; cuBLAS/CUTLASS grouped_mm can win on large ones). Without CUDA: torch or reference."""
    from moe_kernels.grouped_gemm import torch_grouped_mm_supported

    triton_ok = triton_runs_on(x)
    torch_ok = torch_grouped_mm_supported(x, w_gate_up) and torch_grouped_mm_supported(x, w_down)
    if not triton_ok:
        return "torch" if torch_ok else "reference"
    if not torch_ok:
        return "triton"
    key = (tuple(x.shape), tuple(w_gate_up.shape), route_map.top_k, x.dtype)
    choice = _BLOCK_CHOICE.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return "triton"  # no timing inside a capture; warm up first to get the tuned choice
        import triton.testing

        leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
        grad = torch.randn_like(x)
        times = {}
        for b in ("triton", "torch"):

            def step(b=b):
                out = moe_ffn(leaves[0], route_map, leaves[1], leaves[2], leaves[3], backend=b)
                torch.autograd.grad(out, leaves, grad)

            step()
            times[b] = triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")
        choice = min(times, key=times.get)
        _BLOCK_CHOICE[key] = choice
    return choice
