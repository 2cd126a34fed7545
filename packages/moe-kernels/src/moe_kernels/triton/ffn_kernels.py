"""The routed SwiGLU expert FFN with its fusions, forward and backward.

forward   pre, act = SwiGLU(gather(x) @ W1)      one kernel: gather in the A-load, SwiGLU epilogue
          y = act @ W2                           grouped GEMM
          out[t] = sum_s w[t,s] y[dest[t,s]]     one gather-sum kernel (fp32 accumulation)
backward  dy = w * g[token], gw = <g, y>         one kernel per token
          d_pre = SwiGLU'(dy @ W2^T, pre)        one kernel: SwiGLU backward in the epilogue
          dW2 = act^T dy ; dxs = d_pre @ W1^T ; dW1 = gather(x)^T d_pre
          gx[t] = sum_s dxs[dest[t,s]]
The routing weight is applied in the combine rather than in the second GEMM's epilogue: the
combine reads y anyway, and backward needs the unweighted y for the router-weight gradient.
Without routing (`dest_row is None`) the op is swiglu_experts on rows already in expert order.
"""

from __future__ import annotations

import torch

from moe_kernels.triton.grouped_gemm_kernels import grouped_gemm_launch, grouped_wgrad_launch
from moe_kernels.triton.permute_kernels import combine_backward, gather_sum


class SwigluFFNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, w1, w2, offsets, sort_order, dest_row, top_k):
        """x: [T, d] (routed) or [N, d] (sorted rows); w1: [E, d, 2h]; w2: [E, h, d]."""
        x = x.contiguous()
        routed = dest_row is not None
        n_rows = sort_order.shape[0] if routed else x.shape[0]
        h = w2.shape[1]
        pre = torch.empty(n_rows, 2 * h, dtype=x.dtype, device=x.device)
        act = torch.empty(n_rows, h, dtype=x.dtype, device=x.device)
        grouped_gemm_launch(
            x, w1, offsets, out_cols=h, c=act, gather=sort_order if routed else None, top_k=top_k,
            epilogue=1, aux=pre, swiglu_h=h,
        )
        y = torch.empty(n_rows, w2.shape[2], dtype=x.dtype, device=x.device)
        grouped_gemm_launch(act, w2, offsets, out_cols=w2.shape[2], c=y)
        ctx.routed = routed
        ctx.top_k = top_k
        ctx.save_for_backward(x, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y)
        if routed:
            return gather_sum(y, dest_row, top_k, weights)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y = ctx.saved_tensors
        g = g.contiguous()
        routed, k = ctx.routed, ctx.top_k
        gw = None
        if routed:
            dy, gw = combine_backward(g, y, dest_row, weights)
        else:
            dy = g
        h = w2.shape[1]
        d_pre = torch.empty_like(pre)
        grouped_gemm_launch(dy, w2.transpose(1, 2), offsets, out_cols=h, c=d_pre, epilogue=2, aux=pre, swiglu_h=h)
        gw2 = grouped_wgrad_launch(act, dy, offsets, w2.shape[0], out_dtype=w2.dtype) if ctx.needs_input_grad[3] else None
        gx = None
        if ctx.needs_input_grad[0]:
            dxs = torch.empty(d_pre.shape[0], w1.shape[1], dtype=x.dtype, device=x.device)
            grouped_gemm_launch(d_pre, w1.transpose(1, 2), offsets, out_cols=w1.shape[1], c=dxs)
            gx = gather_sum(dxs, dest_row, k) if routed else dxs
        gw1 = None
        if ctx.needs_input_grad[2]:
            gw1 = grouped_wgrad_launch(
                x, d_pre, offsets, w1.shape[0], gather=sort_order if routed else None, top_k=k, out_dtype=w1.dtype
            )
        return gx, gw, gw1, gw2, None, None, None, None


def swiglu_ffn_sorted(x_sorted, w_gate_up, w_down, offsets):
    """x_sorted: [N, d] in expert order -> [N, d]."""
    return SwigluFFNFn.apply(x_sorted, None, w_gate_up, w_down, offsets, None, None, 1)


def swiglu_ffn_routed(x, weights, w_gate_up, w_down, offsets, sort_order, dest_row):
    """x: [T, d], weights: [T, k] -> [T, d]: gather, expert SwiGLU FFN and weighted combine."""
    return SwigluFFNFn.apply(x, weights, w_gate_up, w_down, offsets, sort_order, dest_row, weights.shape[1])
