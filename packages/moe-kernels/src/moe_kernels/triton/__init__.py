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


def _triton_interprets() -> bool:
    """Whether triton runs kernels in its CPU interpreter (its own setting, read through triton)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def require_triton_on(t: torch.Tensor) -> None:
    """Raise a clear error when backend="triton" is asked for where its kernels cannot run:
    triton not installed, or a tensor off CUDA without Triton's CPU interpreter."""
    if not triton_available():
        raise ValueError("backend='triton' needs triton installed (pip install triton); use backend='auto' or 'reference'")
    if t.is_cuda or (t.device.type == "cpu" and _triton_interprets()):
        return
    raise ValueError(
        f"backend='triton' got a tensor on device={t.device}: the triton kernels run on CUDA devices, or on "
        "the CPU only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported); "
        "use backend='auto' or 'reference' here"
    )


def use_triton(backend: str, t: torch.Tensor) -> bool:
    """Whether a call with this backend runs the triton kernels on `t`'s device (one rule for
    every op): "triton" always (after `require_triton_on`), "auto" on CUDA when installed.
    Any other name than auto / triton / torch / reference is refused here, for every op."""
    if backend not in ("auto", "triton", "torch", "reference"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'triton', 'torch', 'reference'")
    if backend == "triton":
        require_triton_on(t)
        return True
    return backend == "auto" and triton_runs_on(t)
