"""Permute and combine as row kernels, with their backward passes.

Every kernel runs one program per token: it reads the token's k destination rows from
`dest_row` and either writes them (permute; combine backward) or sums them (combine; permute
backward). Each output element is written by exactly one program, with no atomics, so the
results are deterministic run to run. Data is upcast to fp32 right after loading (fp32
accumulation, and Triton's interpreter mishandles bf16 arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels.triton.autograd_support import refuse_dual_inputs, refuse_forward_ad, run_backward, vmap_by_loop


def _block_d(d: int) -> int:
    return min(1024, triton.next_power_of_2(d))


@triton.jit
def _scatter_rows_kernel(
    x_ptr, dest_ptr, out_ptr, D, stride_x, stride_out, TOPK: tl.constexpr, BLOCK_D: tl.constexpr
):
    """out[dest[t*k + s]] = x[t] for every slot s."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = cols < D
    row = tl.load(x_ptr + t * stride_x + cols, mask=m)
    for s in tl.static_range(TOPK):
        r = tl.load(dest_ptr + t * TOPK + s)
        tl.store(out_ptr + r * stride_out + cols, row, mask=m)


@triton.jit
def _gather_sum_kernel(
    y_ptr, dest_ptr, w_ptr, out_ptr, D, stride_y, stride_out,
    TOPK: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t] = sum_s w[t, s] * y[dest[t*k + s]] (w = 1 without HAS_W), fp32 accumulation."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(TOPK):
        r = tl.load(dest_ptr + t * TOPK + s)
        v = tl.load(y_ptr + r * stride_y + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * TOPK + s).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_backward_kernel(
    g_ptr, y_ptr, dest_ptr, w_ptr, dy_ptr, gw_ptr, D, stride_g, stride_y, stride_dy,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
):
    """dy[dest[t*k+s]] = w[t,s] * g[t];  gw[t,s] = <g[t], y[dest[t*k+s]]>."""
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, TOPK_P2)
    smask = slots < TOPK
    rows = tl.load(dest_ptr + t * TOPK + slots, mask=smask, other=0)
    w = tl.load(w_ptr + t * TOPK + slots, mask=smask, other=0.0).to(tl.float32)
    gw = tl.zeros([TOPK_P2], dtype=tl.float32)
    for c in range(D_CHUNKS):
        cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
        cm = cols < D
        g = tl.load(g_ptr + t * stride_g + cols, mask=cm, other=0.0).to(tl.float32)
        m2 = smask[:, None] & cm[None, :]
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        gw += tl.sum(y * g[None, :], axis=1)
        dy = w[:, None] * g[None, :]
        tl.store(dy_ptr + rows[:, None] * stride_dy + cols[None, :], dy.to(dy_ptr.dtype.element_ty), mask=m2)
    tl.store(gw_ptr + t * TOPK + slots, gw.to(gw_ptr.dtype.element_ty), mask=smask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def scatter_rows(x: torch.Tensor, dest_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """x: [T, d] -> [T*k, d] with out[dest_row[t*k+s]] = x[t] (permute forward)."""
    x = _rows(x)
    T, D = x.shape
    out = torch.empty(T * top_k, D, dtype=x.dtype, device=x.device)
    if T and D:
        bd = _block_d(D)
        _scatter_rows_kernel[(T, triton.cdiv(D, bd))](x, dest_row, out, D, x.stride(0), out.stride(0), TOPK=top_k, BLOCK_D=bd)
    return out


def gather_sum(y: torch.Tensor, dest_row: torch.Tensor, top_k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """y: [T*k, d] -> [T, d], out[t] = sum_s w[t,s] * y[dest_row[t*k+s]] (combine; permute backward)."""
    y = _rows(y)
    D = y.shape[1]
    T = y.shape[0] // top_k
    out = torch.empty(T, D, dtype=y.dtype, device=y.device)
    if T and D:
        bd = _block_d(D)
        w = weights.contiguous() if weights is not None else y
        _gather_sum_kernel[(T, triton.cdiv(D, bd))](
            y, dest_row, w, out, D, y.stride(0), out.stride(0), TOPK=top_k, HAS_W=weights is not None, BLOCK_D=bd
        )
    return out


def combine_backward(g: torch.Tensor, y: torch.Tensor, dest_row: torch.Tensor, weights: torch.Tensor):
    """g: [T, d], y: [T*k, d], weights: [T, k] -> (dy [T*k, d] in y's dtype, gw [T, k] in weights' dtype)."""
    g = _rows(g)
    y = _rows(y)
    weights = weights.contiguous()
    T, k = weights.shape
    D = y.shape[1]
    dy = torch.empty_like(y)
    gw = torch.empty(T, k, dtype=weights.dtype, device=y.device)
    if T:
        bd = min(256, triton.next_power_of_2(max(D, 1)))
        _combine_backward_kernel[(T,)](
            g, y, dest_row, weights, dy, gw, D, g.stride(0), y.stride(0), dy.stride(0),
            TOPK=k, TOPK_P2=triton.next_power_of_2(k), BLOCK_D=bd, D_CHUNKS=triton.cdiv(D, bd),
        )
    return dy, gw


class PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(x, dest_row, top_k):
        refuse_dual_inputs("PermuteFn", (x,))
        return scatter_rows(x, dest_row, top_k)

    @staticmethod
    def setup_context(ctx, inputs, output):
        refuse_forward_ad("PermuteFn")
        _, dest_row, top_k = inputs
        ctx.save_for_backward(dest_row)
        ctx.top_k = top_k

    @staticmethod
    def backward(ctx, g):
        (dest_row,) = ctx.saved_tensors
        (gx,) = run_backward("PermuteFn", _permute_backward, g, dest_row, ctx.top_k)
        return gx, None, None

    @staticmethod
    def vmap(info, in_dims, x, dest_row, top_k):
        return vmap_by_loop(info, in_dims, PermuteFn.apply, x, dest_row, top_k)


def _permute_backward(g, dest_row, top_k):
    return (gather_sum(g, dest_row, top_k),)


class CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(y, dest_row, weights):
        refuse_dual_inputs("CombineFn", (y, weights))
        return gather_sum(y, dest_row, weights.shape[1], weights)

    @staticmethod
    def setup_context(ctx, inputs, output):
        refuse_forward_ad("CombineFn")
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        y, dest_row, weights = ctx.saved_tensors
        dy, gw = run_backward("CombineFn", combine_backward, g, y, dest_row, weights)
        return dy, None, gw

    @staticmethod
    def vmap(info, in_dims, y, dest_row, weights):
        return vmap_by_loop(info, in_dims, CombineFn.apply, y, dest_row, weights)
