"""Triton kernels behind the reference API (route map, permute/combine, grouped GEMM, fused FFN).

Nothing here imports triton at package import: `moe_kernels` must import on CPU machines
without triton. The kernel modules import it and are loaded only when a triton backend runs.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install on a CPU-only box
        return False
    return True


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether `auto` should pick the triton backend for tensors on this device (CUDA only:
    on the CPU triton runs only under its interpreter, which CI asks for explicitly)."""
    return t.is_cuda and triton_available()
