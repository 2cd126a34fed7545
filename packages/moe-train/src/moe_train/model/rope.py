"""Rotary position embedding (rotate-half layout, as Llama / OLMo / Qwen), one fused kernel on CUDA.

Partial rotary (GLM-4.5: half of each head) rotates the leading rotary_dim dims of a head, rotate-half
within them, with frequencies over rotary_dim, and passes the rest unchanged, as transformers' Glm4Moe
(and GPT-NeoX) do; the tables are then [S, rotary_dim] and apply_rope splits the head.

The torch formula (`rope_reference`) runs seven elementwise kernels in fp32, two of them broadcasts
that torch does not vectorise; on an H200 they were ~7 ms of a 105 ms training step of the
fine-grained E=8 preset. The Triton kernel reads x once and writes the result once, in fp32 inside.
Its backward is the same rotation by the opposite angle (cos, -sin).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from moe_kernels.triton import triton_can_run_on

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without triton: the reference everywhere
    triton = None

_ROWS_PER_PROGRAM = 16


def rope_tables(seq_len: int, rotary_dim: int, theta: float, device: torch.device,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [seq_len, rotary_dim] fp32 (or `dtype`: float64 for a float64 model), in the rotate-half layout
    (rotary_dim: head_dim, or the rotated part of a head under partial rotary)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=dtype) / rotary_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=dtype), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, hd]; cos/sin: [S, hd] fp32 (or float64) -> x rotated, in x's dtype (fp32 arithmetic; float64
    when x or the tables are float64)."""
    wide = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    x1, x2 = x.to(wide).chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.to(wide) * cos + rotated * sin).to(x.dtype)


if triton is not None:

    @triton.jit
    def _rope_kernel(x, out, cos, sin, n_rows, H, S, sxb, sxh, sxs, sob, soh, sos, sign,
                     HALF: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # a row: one (b, h, s) vector of head_dim
        s = rows % S
        bh = rows // S
        h = (bh % H).to(tl.int64)
        b = (bh // H).to(tl.int64)
        s64 = s.to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = (rows < n_rows)[:, None] & (d < HALF)[None, :]
        xp = x + (b * sxb + h * sxh + s64 * sxs)[:, None] + d[None, :]
        op = out + (b * sob + h * soh + s64 * sos)[:, None] + d[None, :]
        tp = (s64 * (2 * HALF))[:, None] + d[None, :]
        x1 = tl.load(xp, mask=mask).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask).to(tl.float32)
        c1 = tl.load(cos + tp, mask=mask)
        c2 = tl.load(cos + tp + HALF, mask=mask)
        s1 = tl.load(sin + tp, mask=mask) * sign
        s2 = tl.load(sin + tp + HALF, mask=mask) * sign
        tl.store(op, (x1 * c1 - x2 * s1).to(out.dtype.element_ty), mask=mask)
        tl.store(op + HALF, (x2 * c2 + x1 * s2).to(out.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    b, h, s, hd = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)  # x's layout (a transposed [B, S, H, hd] view stays one); last stride 1 as x's
    n_rows = b * h * s
    half = hd // 2
    grid = (triton.cdiv(n_rows, _ROWS_PER_PROGRAM),)
    with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
        _rope_kernel[grid](x, out, cos, sin, n_rows, h, s, x.stride(0), x.stride(1), x.stride(2),
                           out.stride(0), out.stride(1), out.stride(2), sign,
                           HALF=half, BLOCK_D=triton.next_power_of_2(half), ROWS=_ROWS_PER_PROGRAM, num_warps=4)
    return out


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.sign = sign
        return _rotate(x, cos, sin, sign)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        # through this Function again, not the bare kernel: a double backward (create_graph) sees the rotation
        return _RopeFn.apply(grad, cos, sin, -ctx.sign), None, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, hd] (any strides); cos/sin: [S, rd] fp32 from rope_tables, rd <= hd -> x with its first rd
    dims rotated and the rest as they were, in x's dtype. The fused kernel on CUDA (cos/sin without gradients),
    rope_reference elsewhere (and for cos/sin that need gradients)."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:  # partial rotary: only the leading dims turn
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    fused = (
        # under torch.compile the reference's ops are what inductor fuses (the kernel would break the graph)
        triton is not None and not torch.compiler.is_compiling() and triton_can_run_on(x) and x.dim() == 4 and x.shape[-1] % 2 == 0 and x.numel() > 0
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)  # the kernel computes in fp32: float64 is not
        and not (cos.requires_grad or sin.requires_grad)
        and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        and cos.shape == sin.shape == (x.shape[2], x.shape[3])
    )
    return _RopeFn.apply(x, cos, sin, 1.0) if fused else rope_reference(x, cos, sin)
