"""The routed-expert SwiGLU FFN as functional ops.

`swiglu_experts` runs on rows already in expert order (after a dispatcher); `moe_ffn` is the
whole block from token rows: gather, two grouped GEMMs with SwiGLU, weighted combine. The
triton backend fuses the gather into the first GEMM's A-load and SwiGLU (forward and
backward) into GEMM epilogues; the torch backend on a GPU runs torch grouped_mm GEMMs between
our permute, one-pass SwiGLU and combine kernels; elsewhere torch and reference compose the
unfused ops.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from moe_kernels.grouped_gemm import (
    GemmBackend,
    checked_offsets,
    grouped_gemm,
    require_torch_grouped_mm,
    torch_grouped_mm_supported,
)
from moe_kernels.permute import EXPERT_DTYPES, check_router_weights, check_rows, check_token_rows, combine, permute
from moe_kernels.plan_search import search_plan
from moe_kernels.route_map import RouteMap, require_tensor
from moe_kernels.triton import use_triton


def _check_weights(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
    require_tensor("w_gate_up", w_gate_up, "[E, d, 2h]")
    require_tensor("w_down", w_down, "[E, h, d]")
    if x.dtype not in EXPERT_DTYPES:
        raise ValueError(
            f"the expert rows are {x.dtype}: the SwiGLU experts compute in "
            f"{', '.join(str(d) for d in EXPERT_DTYPES)}; cast x and the expert weights to one of them"
        )
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} are not [E, d, 2h], [E, h, d]")
    E, d, two_h = w_gate_up.shape
    if two_h % 2 or tuple(w_down.shape) != (E, two_h // 2, d):
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} are not [E, d, 2h], [E, h, d]")
    if x.shape[-1] != d:
        raise ValueError(f"x has d={x.shape[-1]} but w_gate_up has d={d}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(
                f"{name} is {w.dtype} on {w.device} but x is {x.dtype} on {x.device}: cast the activations "
                "or the weights so they match"
            )


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
    check_rows("x_sorted", x_sorted, "N")
    _check_weights(x_sorted, w_gate_up, w_down)
    offsets = checked_offsets(offsets, x_sorted.shape[0], x_sorted.device, w_gate_up.shape[0])
    plan = _plan(backend, x_sorted, w_gate_up, w_down, offsets)
    if plan is not None:
        from moe_kernels.triton.ffn_kernels import swiglu_ffn_sorted

        return swiglu_ffn_sorted(x_sorted, w_gate_up, w_down, offsets, plan)
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
    check_token_rows(x, route_map)
    _check_weights(x, w_gate_up, w_down)
    if route_map.num_experts != w_gate_up.shape[0]:
        raise ValueError(f"the route map has {route_map.num_experts} experts but w_gate_up has {w_gate_up.shape[0]}")
    check_router_weights(weights, x, route_map)
    # a route map built by hand may carry int64 offsets (grouped_mm takes int32 only) or wrong ones
    offsets = checked_offsets(route_map.offsets, route_map.num_rows, x.device, route_map.num_experts)
    plan = _plan(backend, x, w_gate_up, w_down, offsets, route_map)
    if plan is not None:
        from moe_kernels.triton.ffn_kernels import swiglu_ffn_routed

        return swiglu_ffn_routed(x, weights, w_gate_up, w_down, offsets, route_map.sort_order, route_map.dest_row, plan)
    # torch grouped_mm (or reference) GEMMs composed with permute and combine (CPU, or no triton)
    rows_backend = "reference" if backend == "reference" else "auto"
    y = swiglu_experts(permute(x, route_map, rows_backend), w_gate_up, w_down, offsets, backend)
    return combine(y, route_map, weights, rows_backend)


def _require_grouped_mm_block(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
    if 0 not in (w_gate_up.shape[1], w_down.shape[1]):  # an empty d or h runs on every backend
        require_torch_grouped_mm(x, w_gate_up)
        require_torch_grouped_mm(x, w_down, in_cols=w_down.shape[1])


_PLANS: dict[tuple, object] = {}


def _plan(
    backend: str, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, offsets: torch.Tensor,
    route_map: RouteMap | None = None,
):
    """The BlockPlan the triton-side block runs for this backend, or None for the composed ops.

    triton: every GEMM on our Triton kernels, with the fusions. torch, on a GPU: every GEMM on
    torch grouped_mm between our permute, SwiGLU and combine kernels. auto, on a GPU: the
    fastest of a GEMM-by-GEMM choice between the two, all-Triton and all-grouped_mm, timed once
    per shape (rows bucketed to a power of two) and cached; then plans one GEMM away from the
    winner are timed as whole blocks and a change is kept when it is >1% faster."""
    if backend == "torch":  # before any work: both GEMMs must suit grouped_mm, or neither runs
        _require_grouped_mm_block(x, w_gate_up, w_down)
    if backend == "reference" or not use_triton("auto" if backend == "torch" else backend, x):
        return None
    if 0 in (w_gate_up.shape[1], w_down.shape[1]):  # d = 0 or h = 0: the composed ops give the zeros
        return None
    from moe_kernels.triton import ffn_kernels

    mm_ok = torch_grouped_mm_supported(x, w_gate_up) and torch_grouped_mm_supported(x, w_down, in_cols=w_down.shape[1])
    if backend == "triton" or (backend == "auto" and not mm_ok):
        return ffn_kernels.ALL_TRITON
    if backend == "torch":
        return ffn_kernels.ALL_GROUPED_MM if mm_ok else None
    if torch.compiler.is_compiling():  # the trace has no data to time: the block op picks the plan when it runs
        return "auto"
    routing = (route_map.sort_order, route_map.dest_row, route_map.top_k) if route_map is not None else None
    return auto_plan(x, w_gate_up, w_down, offsets, routing)


def auto_plan(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, offsets: torch.Tensor,
              routing: tuple[torch.Tensor, torch.Tensor, int] | None):
    """backend="auto"'s BlockPlan for these operands (routing: (sort_order, dest_row, top_k), or None for rows
    already in expert order): cached per shape, else timed on them and cached. All-Triton, uncached, inside a
    CUDA-graph capture or on inference tensors. The timing runs the block's forward and backward functions
    directly, outside autograd: whatever the caller's autograd state (no_grad, activation checkpointing's
    saved-tensor hooks, a custom op's below-autograd dispatch), nothing of its graph is touched."""
    from moe_kernels.triton import ffn_kernels
    from moe_kernels.triton.tuning import rows_bucket

    top_k = routing[2] if routing is not None else 1
    key = (rows_bucket(x.shape[0]), tuple(w_gate_up.shape), top_k, x.dtype, routing is not None)
    plan = _PLANS.get(key)
    if plan is None:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        routing_tensors = list(routing[:2]) if routing is not None else []
        if capturing or torch.is_inference_mode_enabled() or any(
            t.is_inference() for t in (x, w_gate_up, w_down, offsets, *routing_tensors)
        ):
            # no timing inside a capture, nor on inference tensors (made under inference_mode, maybe used
            # outside it); not cached: the next call times the plans
            return ffn_kernels.ALL_TRITON
        plan = _time_plans(x, w_gate_up, w_down, offsets, routing, key)
        _PLANS[key] = plan
    return plan


def _time_plans(x, w_gate_up, w_down, offsets, routing, key=None):
    """The GEMM-by-GEMM plan from timing each GEMM alone, all-Triton and all-grouped_mm seed a
    local search timed on the whole block forward+backward (plan_search): GEMMs timed alone do
    not always add up (L2 reuse, launch gaps, clocks under a power cap), so the whole block
    decides, one GEMM's implementation at a time. Timing runs on the caller's
    tensors (no copies of the weights); if it runs out of memory, the all-Triton plan, which
    needs the least, is used and a warning names the shape."""
    from moe_kernels.triton import ffn_kernels

    try:
        return _fastest_plan(x, w_gate_up, w_down, offsets, routing, key)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        warnings.warn(
            f"moe_kernels: out of memory while timing block plans for x {tuple(x.shape)}, w_gate_up "
            f"{tuple(w_gate_up.shape)}; using the all-Triton plan", stacklevel=3,
        )
        return ffn_kernels.ALL_TRITON


def _fastest_plan(x, w_gate_up, w_down, offsets, routing, key=None):
    import triton.testing

    from moe_kernels.triton import dense_rows, ffn_kernels

    sort_order, dest_row, top_k = routing if routing is not None else (None, None, 1)
    x, w1, w2 = dense_rows(x.detach()), w_gate_up.detach(), w_down.detach()  # views: no copies
    by_gemm = ffn_kernels.tune_block_plan(x, w1, w2, offsets, sort_order, dest_row, top_k)
    gen = torch.Generator(device=x.device).manual_seed(0)
    grad = torch.randn(x.shape, device=x.device, generator=gen).to(x.dtype)
    weights = None
    if routing is not None:
        weights = torch.rand(x.shape[0], top_k, device=x.device, generator=gen)
    every_gradient = (True, True, True, True)

    def step(plan):
        out, xs, pre, act, y = ffn_kernels.block_forward(x, weights, w1, w2, offsets, sort_order, dest_row, top_k, plan)
        if routing is None:
            xs, y = x, out
        ffn_kernels.block_backward(grad, x, xs, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y,
                                   routing is not None, top_k, plan, every_gradient)

    warmed: set = set()

    def measure(plans):
        # plans interleaved over rounds, so a drift in clocks during tuning favours none of them;
        # a block takes 2-40 ms, so a round of 80 ms holds a few calls of each at the largest shapes
        for plan in plans:
            if plan not in warmed:
                step(plan)  # compiles and tunes the GEMMs' block shapes outside the timing
                warmed.add(plan)
        times: dict = {plan: [] for plan in plans}
        for _ in range(_PLAN_ROUNDS):
            for plan in plans:
                times[plan].append(triton.testing.do_bench(lambda plan=plan: step(plan), warmup=10, rep=80, return_mode="median"))
        return {plan: sorted(t)[len(t) // 2] for plan, t in times.items()}

    options = dict(ffn_kernels.PLAN_OPTIONS)
    if routing is None:  # rows already in order: fwd1 "triton" would run "fused" again
        options["fwd1"] = tuple(o for o in options["fwd1"] if o != "triton")
    best, seen = search_plan([by_gemm, ffn_kernels.ALL_TRITON, ffn_kernels.ALL_GROUPED_MM], measure, options, _PLAN_MIN_GAIN)
    _PLAN_SEARCH_MS[key] = seen
    return best


_PLAN_ROUNDS = 3
_PLAN_MIN_GAIN = 0.01  # a one-GEMM change is kept only when the whole block gets >1% faster


def tuned_plans() -> dict[tuple, object]:
    """The per-shape GEMM plans `auto` has chosen so far (for benchmark reports)."""
    return dict(_PLANS)


_PLAN_SEARCH_MS: dict = {}


def plan_search_times() -> dict[tuple, dict]:
    """Per tuning key, every plan the search timed and its whole-block time in ms (for benchmark reports)."""
    return {k: dict(v) for k, v in _PLAN_SEARCH_MS.items()}
