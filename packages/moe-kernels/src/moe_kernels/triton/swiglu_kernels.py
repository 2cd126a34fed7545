"""SwiGLU as one elementwise pass each way, for GEMMs that cannot take it as an epilogue.

pre = [gate | up] (h columns each): act = silu(gate) * up; backward reads pre and d_act and
writes d_pre = [d_gate | d_up] in one pass (no saved silu output, no concatenation). The
arithmetic is in fp32 on values rounded to the storage dtype, as in the fused GEMM epilogues.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_R = 8
_BLOCK_H = 256


@triton.jit
def _swiglu_kernel(
    pre_ptr, act_ptr, d_act_ptr, d_pre_ptr, R, H, stride_p, stride_a, stride_da, stride_dp,
    BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (rows < R)[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    p = pre_ptr + r64 * stride_p + cols[None, :]
    g = tl.load(p, mask=m, other=0.0).to(tl.float32)
    u = tl.load(p + H, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    if BACKWARD:
        da = tl.load(d_act_ptr + r64 * stride_da + cols[None, :], mask=m, other=0.0).to(tl.float32)
        q = d_pre_ptr + r64 * stride_dp + cols[None, :]
        out_ty = d_pre_ptr.dtype.element_ty
        tl.store(q, (da * u * sig * (1.0 + g * (1.0 - sig))).to(out_ty), mask=m)
        tl.store(q + H, (da * g * sig).to(out_ty), mask=m)
    else:
        tl.store(act_ptr + r64 * stride_a + cols[None, :], (g * sig * u).to(act_ptr.dtype.element_ty), mask=m)


def _grid(rows: int, h: int):
    return (triton.cdiv(rows, _BLOCK_R), triton.cdiv(h, _BLOCK_H))


def swiglu_forward(pre: torch.Tensor) -> torch.Tensor:
    """pre: [R, 2h] (gate then up) -> act [R, h]."""
    R, h = pre.shape[0], pre.shape[1] // 2
    act = torch.empty(R, h, dtype=pre.dtype, device=pre.device)
    if R and h:
        pre = pre if pre.stride(-1) == 1 else pre.contiguous()
        _swiglu_kernel[_grid(R, h)](
            pre, act, act, act, R, h, pre.stride(0), act.stride(0), 0, 0,
            BACKWARD=False, BLOCK_R=_BLOCK_R, BLOCK_H=_BLOCK_H,
        )
    return act


def swiglu_backward(d_act: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """d_act: [R, h], pre: [R, 2h] -> d_pre [R, 2h]."""
    R, h = pre.shape[0], pre.shape[1] // 2
    d_pre = torch.empty(R, 2 * h, dtype=pre.dtype, device=pre.device)
    if R and h:
        pre = pre if pre.stride(-1) == 1 else pre.contiguous()
        d_act = d_act if d_act.stride(-1) == 1 else d_act.contiguous()
        _swiglu_kernel[_grid(R, h)](
            pre, d_pre, d_act, d_pre, R, h, pre.stride(0), 0, d_act.stride(0), d_pre.stride(0),
            BACKWARD=True, BLOCK_R=_BLOCK_R, BLOCK_H=_BLOCK_H,
        )
    return d_pre
