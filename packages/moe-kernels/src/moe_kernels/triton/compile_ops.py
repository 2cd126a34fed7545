"""The triton backend under torch.compile: each op as a torch.library custom op.

Dynamo cannot trace into the kernels' launchers (the block-shape tuning, tensor-descriptor
alignment checks on `data_ptr()`, the plan search's timings), so under torch.compile the public
ops call these opaque custom ops instead of the autograd Functions: `fullgraph=True` holds, and
inductor schedules around them. Each forward op has a fake (shapes only) and a backward made of
another custom op; both run exactly the code the autograd Functions run in eager mode.

Outputs are fixed per op (a custom op returns no None and no alias): a gradient that was not
asked for comes back as an empty tensor and leaves as None. The block op takes its plan as a
string; "auto" is resolved when the op runs, by `expert_ffn.auto_plan` (timed once per shape,
cached, as in eager), because the trace sees no data to time. Its forward returns (out, pre, act,
y) and not the permuted rows: a plan that needs them in the backward permutes x again there.

This module is imported only where the triton kernels run (it imports them).
"""

from dataclasses import astuple
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from moe_kernels.triton.ffn_kernels import BlockPlan, block_backward, block_forward, sorted_rows
from moe_kernels.triton.grouped_gemm_kernels import grouped_gemm_backward, grouped_gemm_forward
from moe_kernels.triton.permute_kernels import combine_backward, gather_sum, scatter_rows
from moe_kernels.triton.route_map_kernels import route_map_tensors


def _asked_for(t: Tensor, wanted: bool) -> Optional[Tensor]:
    return t if wanted else None


def _nothing(like: Tensor) -> Tensor:
    """The placeholder of a gradient that was not asked for."""
    return like.new_empty(0)


def _fake_grad(like: Tensor, wanted: bool) -> Tensor:
    """A fake's gradient output: `like`'s shape when asked for, else the placeholder."""
    return like.new_empty(like.shape) if wanted else _nothing(like)


# ---- route map (no gradient) ----

@custom_op("moe_kernels::route_map", mutates_args=())
def route_map(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(counts [E] i32, offsets [E] i32, sort_order [T*k] i64, dest_row [T*k] i64, ids_ok [] i32)."""
    return route_map_tensors(expert_ids, num_experts)


@route_map.register_fake
def _(expert_ids, num_experts):
    rows = expert_ids.numel()
    i32 = dict(dtype=torch.int32, device=expert_ids.device)
    i64 = dict(dtype=torch.int64, device=expert_ids.device)
    return (torch.empty(num_experts, **i32), torch.empty(num_experts, **i32), torch.empty(rows, **i64),
            torch.empty(rows, **i64), torch.empty((), **i32))


# ---- permute and combine ----

@custom_op("moe_kernels::permute_rows", mutates_args=())
def permute_rows(x: Tensor, dest_row: Tensor, top_k: int) -> Tensor:
    """x: [T, d] -> [T*k, d] in expert order."""
    return scatter_rows(x, dest_row, top_k)


@permute_rows.register_fake
def _(x, dest_row, top_k):
    return x.new_empty(dest_row.shape[0], x.shape[1])


@custom_op("moe_kernels::combine_rows", mutates_args=())
def combine_rows(y: Tensor, dest_row: Tensor, top_k: int, weights: Optional[Tensor]) -> Tensor:
    """y: [T*k, d] -> [T, d], each token's k rows summed (weighted when `weights` is given)."""
    return gather_sum(y, dest_row, top_k, weights)


@combine_rows.register_fake
def _(y, dest_row, top_k, weights):
    return y.new_empty(y.shape[0] // top_k, y.shape[1])


@custom_op("moe_kernels::combine_rows_backward", mutates_args=())
def combine_rows_backward(g: Tensor, y: Tensor, dest_row: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(dy [T*k, d], g_weights [T, k])."""
    return combine_backward(g, y, dest_row, weights)


@combine_rows_backward.register_fake
def _(g, y, dest_row, weights):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


def _permute_setup(ctx, inputs, output):
    _, dest_row, top_k = inputs
    ctx.save_for_backward(dest_row)
    ctx.top_k = top_k


def _permute_backward(ctx, g):
    (dest_row,) = ctx.saved_tensors
    return combine_rows(g, dest_row, ctx.top_k, None), None, None


permute_rows.register_autograd(_permute_backward, setup_context=_permute_setup)


def _combine_setup(ctx, inputs, output):
    y, dest_row, top_k, weights = inputs
    ctx.save_for_backward(y, dest_row, weights)
    ctx.top_k = top_k


def _combine_backward(ctx, g):
    y, dest_row, weights = ctx.saved_tensors
    if weights is None:  # the permute's backward, differentiated again
        return permute_rows(g, dest_row, ctx.top_k), None, None, None
    dy, gw = combine_rows_backward(g, y, dest_row, weights)
    return dy, None, None, gw


combine_rows.register_autograd(_combine_backward, setup_context=_combine_setup)


# ---- grouped GEMM ----

@custom_op("moe_kernels::grouped_gemm", mutates_args=())
def grouped_gemm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x: [N, K] (contiguous) @ w: [E, K, M] per expert -> [N, M]."""
    return grouped_gemm_forward(x, w, offsets)


@grouped_gemm.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[2])


@custom_op("moe_kernels::grouped_gemm_backward", mutates_args=())
def grouped_gemm_backward_op(gy: Tensor, x: Tensor, w: Tensor, offsets: Tensor, need_x: bool,
                             need_w: bool) -> tuple[Tensor, Tensor]:
    gx, gw, _ = grouped_gemm_backward(gy, x, w, offsets, (need_x, need_w))
    return (gx if need_x else _nothing(x)), (gw if need_w else _nothing(w))


@grouped_gemm_backward_op.register_fake
def _(gy, x, w, offsets, need_x, need_w):
    return _fake_grad(x, need_x), _fake_grad(w, need_w)


def _gemm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gemm_backward(ctx, gy):
    x, w, offsets = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    gx, gw = grouped_gemm_backward_op(gy, x, w, offsets, need_x, need_w)
    return _asked_for(gx, need_x), _asked_for(gw, need_w), None


grouped_gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)


# ---- the SwiGLU expert block ----

def plan_name(plan: BlockPlan | str) -> str:
    """A BlockPlan as the string the block op takes ("auto" stays "auto")."""
    return plan if isinstance(plan, str) else ",".join(astuple(plan))


def _plan_of(name: str, x, w1, w2, offsets, sort_order, dest_row, top_k) -> BlockPlan:
    if name != "auto":
        return BlockPlan(*name.split(","))
    from moe_kernels.expert_ffn import auto_plan

    routing = (sort_order, dest_row, top_k) if dest_row is not None else None
    return auto_plan(x, w1, w2, offsets, routing)


@custom_op("moe_kernels::swiglu_block", mutates_args=())
def swiglu_block(x: Tensor, weights: Optional[Tensor], w1: Tensor, w2: Tensor, offsets: Tensor,
                 sort_order: Optional[Tensor], dest_row: Optional[Tensor], top_k: int,
                 plan: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, pre, act, y): the block's output and what its backward reads (y is empty without routing)."""
    p = _plan_of(plan, x, w1, w2, offsets, sort_order, dest_row, top_k)
    out, _, pre, act, y = block_forward(x, weights, w1, w2, offsets, sort_order, dest_row, top_k, p)
    return out, pre, act, (y if y is not None else x.new_empty(0, w2.shape[2]))


@swiglu_block.register_fake
def _(x, weights, w1, w2, offsets, sort_order, dest_row, top_k, plan):
    routed = dest_row is not None
    n, h, d = (sort_order.shape[0] if routed else x.shape[0]), w2.shape[1], w2.shape[2]
    return (x.new_empty(x.shape[0], d), x.new_empty(n, 2 * h), x.new_empty(n, h),
            x.new_empty(n if routed else 0, d))


@custom_op("moe_kernels::swiglu_block_backward", mutates_args=())
def swiglu_block_backward(g: Tensor, x: Tensor, weights: Optional[Tensor], w1: Tensor, w2: Tensor, offsets: Tensor,
                          sort_order: Optional[Tensor], dest_row: Optional[Tensor], pre: Tensor, act: Tensor,
                          y: Tensor, top_k: int, plan: str, need_x: bool, need_w1: bool,
                          need_w2: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(gx, g_weights, g_w1, g_w2); g_weights is empty without routing."""
    p = _plan_of(plan, x, w1, w2, offsets, sort_order, dest_row, top_k)
    routed = dest_row is not None
    xs = sorted_rows(x, dest_row, top_k, p)
    needs = (need_x, routed, need_w1, need_w2)
    gx, gw, gw1, gw2 = block_backward(g, x, xs, weights, w1, w2, offsets, sort_order, dest_row, pre, act,
                                      y if routed else None, routed, top_k, p, needs)
    return (gx if need_x else _nothing(x), gw if routed else _nothing(x), gw1 if need_w1 else _nothing(w1),
            gw2 if need_w2 else _nothing(w2))


@swiglu_block_backward.register_fake
def _(g, x, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y, top_k, plan, need_x, need_w1, need_w2):
    g_weights = _fake_grad(weights, True) if dest_row is not None else _nothing(x)
    return _fake_grad(x, need_x), g_weights, _fake_grad(w1, need_w1), _fake_grad(w2, need_w2)


def _block_setup(ctx, inputs, output):
    x, weights, w1, w2, offsets, sort_order, dest_row, top_k, plan = inputs
    _, pre, act, y = output
    ctx.mark_non_differentiable(pre, act, y)
    ctx.save_for_backward(x, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y)
    ctx.top_k, ctx.plan = top_k, plan


def _block_backward(ctx, g, *intermediates):
    x, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y = ctx.saved_tensors
    need_x, need_weights, need_w1, need_w2 = ctx.needs_input_grad[:4]
    gx, gw, gw1, gw2 = swiglu_block_backward(g, x, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y,
                                             ctx.top_k, ctx.plan, need_x, need_w1, need_w2)
    routed = dest_row is not None
    return (_asked_for(gx, need_x), _asked_for(gw, routed and need_weights), _asked_for(gw1, need_w1),
            _asked_for(gw2, need_w2), None, None, None, None, None)


swiglu_block.register_autograd(_block_backward, setup_context=_block_setup)
