"""Grouped GEMM over exact per-expert row counts (no padding).

x: [N, K] rows in expert order, w: [E, K, M], offsets: [E] int32 cumulative row ends -> [N, M].
"""

from __future__ import annotations

from typing import Literal

import torch

from moe_kernels.forward_ad import forward_ad_active
from moe_kernels.permute import EXPERT_DTYPES
from moe_kernels.route_map import require_tensor
from moe_kernels.triton import at_own_dtype, dense_rows, use_triton

GemmBackend = Literal["auto", "triton", "torch", "reference"]


def _check_ends(ends: list[int], num_rows: int) -> None:
    """Offsets read on the host: non-decreasing cumulative row ends from 0 that end at num_rows."""
    steps = [b - a for a, b in zip([0] + ends[:-1], ends)]
    if (ends and min(steps) < 0) or (ends[-1] if ends else 0) != num_rows:
        raise ValueError(
            f"offsets {ends if len(ends) <= 16 else ends[:8] + ['...']} must be non-decreasing cumulative "
            f"row ends from 0 that end at the number of rows, {num_rows}"
        )


def checked_offsets(offsets: torch.Tensor, num_rows: int, device: torch.device, num_experts: int) -> torch.Tensor:
    """The offsets as the kernels take them ([E] int32, contiguous), after the checks that need no
    host read on a GPU: shape, integer dtype, on the rows' device, and no rows without experts. On
    the CPU (reading is free there) also: non-decreasing, non-negative, last == the row count. On a
    GPU, offsets that do not end at the row count leave the rows past the last end uncomputed."""
    require_tensor("offsets", offsets, f"[E={num_experts}] of cumulative row ends")
    if offsets.device != device:
        raise ValueError(f"offsets are on device={offsets.device} but the rows are on device={device}")
    if offsets.shape != (num_experts,):
        raise ValueError(f"offsets shape {tuple(offsets.shape)} != (num_experts,)=({num_experts},)")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be int32 (or int64) cumulative row ends, got dtype={offsets.dtype}")
    if num_experts == 0 and num_rows != 0:  # no expert owns them: the kernels would leave them unwritten
        raise ValueError(f"there are {num_rows} rows but no experts (E=0): nothing would compute them")
    if offsets.device.type == "cpu" and torch.compiler.is_compiling():  # a traced graph cannot branch on data
        steps = torch.diff(offsets, prepend=offsets.new_zeros(1))
        ends_ok = (steps >= 0).all() & (offsets[-1:] == num_rows).all() if num_experts else num_rows == 0
        # (the message names no row count: formatting a symbolic one would specialise a dynamic shape)
        torch._assert_async(torch.as_tensor(ends_ok), "offsets must be non-decreasing cumulative row ends from 0 that end at the number of rows")
    elif offsets.device.type == "cpu":
        _check_ends(offsets.tolist(), num_rows)
    # the kernels read the offsets as a flat array (a strided view would give wrong experts), and
    # grouped_mm wants stride 1 even for E = 1, where .contiguous() keeps a view's stride
    return dense_rows(offsets.to(torch.int32))


def _check_operands(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x: [N, K], w: [E, K, M] of one dtype and device; returns the checked offsets."""
    require_tensor("x", x, "[N, K]")
    require_tensor("w", w, "[E, K, M]")
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"expected x [N, K] and w [E, K, M], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but w has K={w.shape[1]}")
    offsets = checked_offsets(offsets, x.shape[0], x.device, w.shape[0])
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and w ({w.dtype}, {w.device}) must share dtype and device")
    if x.dtype not in EXPERT_DTYPES:  # an integer GEMM wraps (uint8 200 * 200 * 8 gave 0); fp8 needs scales
        raise ValueError(f"x and w are {x.dtype}: the grouped GEMM computes in "
                         f"{', '.join(str(d) for d in EXPERT_DTYPES)}; cast both to one of them")
    return offsets


def _per_expert_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ends = offsets.tolist()
    _check_ends(ends, x.shape[0])  # read here anyway (on a GPU too)
    with at_own_dtype(x):
        outs = [x[start:end] @ w[e] for e, (start, end) in enumerate(zip([0] + ends[:-1], ends))]
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w.shape[-1])


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-expert loop. Reads the offsets back to the host: a reference, not a fast path.
    The same operand checks as grouped_gemm."""
    return _per_expert_loop(x, w, _check_operands(x, w, offsets))


def _grouped_mm_reads(w: torch.Tensor) -> bool:
    """Whether torch's grouped_mm takes w [E, K, M] as laid out: a unit stride in one of its last
    two dims and the other a multiple of 16 bytes, at least the unit-stride dim's extent (else it
    raises "Invalid strides/sizes" or "strides should be multiple of 16 bytes"; a slice such as
    w[..., ::2] has no unit stride, and an expand()ed w a stride of 0, which passed the 16-byte
    test before 0.10.0 and reached grouped_mm's error)."""
    if w.stride(-1) == 1:
        other, extent = w.stride(-2), w.shape[-1]
    elif w.stride(-2) == 1:
        other, extent = w.stride(-1), w.shape[-2]
    else:
        return False
    return other >= extent and (other * w.element_size()) % 16 == 0


def torch_grouped_mm_supported(x: torch.Tensor, w: torch.Tensor, in_cols: int | None = None) -> bool:
    """Whether torch's grouped_mm kernel handles x [N, in_cols] @ w [E, in_cols, M] on x's device
    (in_cols defaults to x's columns; the second GEMM of a block passes its hidden size)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    in_cols = x.shape[1] if in_cols is None else in_cols
    # rows of 16-byte multiples are required by the CUDA and the CPU kernels alike
    rows_aligned = (in_cols * x.element_size()) % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0
    rows_aligned = rows_aligned and _grouped_mm_reads(w)
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
        return rows_aligned
    if x.device.type == "cpu":
        return x.dtype == torch.float32 and rows_aligned
    return False


def require_torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, in_cols: int | None = None) -> None:
    """backend="torch" asked for a GEMM torch's grouped_mm cannot run: say why, before any work."""
    if not torch_grouped_mm_supported(x, w, in_cols):
        in_cols = x.shape[1] if in_cols is None else in_cols
        raise ValueError(
            f"torch grouped_mm does not support x {x.dtype} [{x.shape[0]}, {in_cols}] @ w {tuple(w.shape)} (strides "
            f"{w.stride()}) on device={x.device}: it needs bf16 on an sm90+ GPU or fp32 on the CPU, rows whose bytes "
            "(K and M times the element size) are multiples of 16, and w with a unit stride in one of its last two "
            "dims and the other a multiple of 16 bytes, at least that dim's size (an expand()ed w, stride 0, has "
            "not: w.contiguous() has); use backend='auto' or 'reference'"
        )


class _DenseRowsGrad(torch.autograd.Function):
    """Identity forward; the gradient leaves with row-major strides, which grouped_mm's backward
    needs (an autograd.Function rather than a tensor hook, so torch.compile traces it whole).
    Forward without ctx plus setup_context, and a generated vmap rule: torch.func (grad, vmap,
    functional_call under grad) refuses an autograd.Function of the older ctx-in-forward form."""

    generate_vmap_rule = True

    @staticmethod
    def forward(t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass  # nothing saved: the backward only restrides the gradient

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return dense_rows(grad)


def grouped_gemm_torch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = torch._grouped_mm(dense_rows(x), w, offs=offsets)
    return _DenseRowsGrad.apply(out) if out.requires_grad else out


def grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, backend: GemmBackend = "auto"
) -> torch.Tensor:
    """x: [N, K], w: [E, K, M], offsets: [E] int32 -> [N, M]. Autograd flows to x and w.

    backend: "triton" (device-scheduled persistent kernel), "torch" (torch grouped_mm),
    "reference" (per-expert loop, reads offsets on the host), "auto" (triton on CUDA when
    installed, else torch grouped_mm where supported and not under forward-mode AD, else reference).
    """
    offsets = _check_operands(x, w, offsets)
    triton = use_triton(backend, x)  # checks the backend name (and triton's dtype and device) first
    if 0 in (x.shape[1], w.shape[2]):  # K or M empty: grouped_mm and the triton kernels refuse it; zeros here
        return _per_expert_loop(x, w, offsets)
    if triton:
        if torch.compiler.is_compiling():
            from moe_kernels.triton.compile_ops import grouped_gemm as grouped_gemm_op

            return grouped_gemm_op(x.contiguous(), w, offsets)
        from moe_kernels.triton.grouped_gemm_kernels import GroupedGemmFn

        return GroupedGemmFn.apply(x.contiguous(), w, offsets)
    if backend == "reference":
        return _per_expert_loop(x, w, offsets)
    forward_ad = forward_ad_active((x, w))  # torch's grouped_mm has no forward derivative
    if backend == "torch":
        require_torch_grouped_mm(x, w)
        if forward_ad:
            raise RuntimeError(
                "grouped_gemm: forward-mode AD (torch.func.jvp, jacfwd, hessian, linearize; torch.autograd."
                "forward_ad's dual tensors) is not supported with backend='torch' (torch's grouped_mm has no "
                "forward derivative); use backend='reference' for that transform (backend='auto' takes it on the CPU)"
            )
        return grouped_gemm_torch(x, w, offsets)
    if torch_grouped_mm_supported(x, w) and not forward_ad:
        return grouped_gemm_torch(x, w, offsets)
    return _per_expert_loop(x, w, offsets)
