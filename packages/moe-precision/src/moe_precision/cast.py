"""The weight cast in front of a low-precision GEMM, with a fast gradient cast back.

A master weight (fp32) is cast to the GEMM dtype (bf16) every forward; its gradient comes back in
bf16 and must be cast up to fp32. torch's own cast for that direction (what autocast's and `.to()`'s
backward run) is not vectorised: on an H100 it moved bf16 -> fp32 at 1.95 TB/s, a Triton kernel at
2.80 TB/s (`bench/cast_bandwidth.py`, `bench/results/h100_cast_bandwidth.json`; an H200 figure of 2.1 vs 3.95 TB/s
was timed by hand and is unconfirmed, see the moe-precision README). At 6.75B expert parameters that is ~21 ms
against ~14 ms of every training step on the H100. `cast_weight` does the forward cast with torch and the
backward one with that kernel on CUDA (torch's `.to()` elsewhere: the reference).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without triton: the torch cast everywhere
    triton = None

_UPCAST_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _upcast_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(tl.float32), mask=mask)


def upcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t cast to `dtype`: a new tensor, exactly `t.to(dtype)`; a contiguous bf16/fp16 CUDA tensor going to
    fp32 through the Triton kernel (every value of those formats is exact in fp32, so it is the same cast)."""
    fast = (  # a plain tensor only: a DTensor or a torch.func wrapper reports shapes and strides its storage lacks
        triton is not None and type(t) is torch.Tensor and not torch._C._are_functorch_transforms_active()
        and t.is_cuda and t.is_contiguous() and dtype == torch.float32
        and t.dtype in (torch.bfloat16, torch.float16) and t.numel() > 0
    )
    if not fast:
        return t.to(dtype)
    out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    n = t.numel()
    with torch.cuda.device(t.device):
        _upcast_kernel[(triton.cdiv(n, _UPCAST_BLOCK),)](t, out, n, BLOCK=_UPCAST_BLOCK, num_warps=8)
    return out


class _CastWeight(torch.autograd.Function):
    """w.to(dtype) with upcast() as its backward; torch.func (grad, vmap, jvp) and forward-mode AD run through it as
    through `.to()` (setup_context, a generated vmap rule, a jvp: the tangent cast as the value is)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return w.to(dtype)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        w, dtype = inputs
        ctx.source_dtype, ctx.dtype = w.dtype, dtype

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if torch.is_grad_enabled():  # a double backward (create_graph): torch's cast, which autograd records
            return grad.to(ctx.source_dtype), None
        return upcast(grad.contiguous(), ctx.source_dtype), None

    @staticmethod
    def jvp(ctx, w_tangent: torch.Tensor, _dtype: None) -> torch.Tensor:
        return w_tangent.to(ctx.dtype)


def cast_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w as `dtype` for a GEMM, differentiable (the gradient comes back in w's dtype); w itself when it
    already is `dtype` (bf16 resident weights)."""
    if w.dtype == dtype:
        return w
    if torch.compiler.is_compiling():  # inductor writes its own cast both ways (the kernel would break the graph)
        return w.to(dtype)
    return _CastWeight.apply(w, dtype)
