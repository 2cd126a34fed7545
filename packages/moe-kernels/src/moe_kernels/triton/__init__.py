"""Triton kernels behind the reference API (route map, permute/combine, grouped GEMM, fused FFN).

Nothing here imports triton at package import: `moe_kernels` must import on CPU machines
without triton. The kernel modules import it and are loaded only when a triton backend runs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from moe_kernels.compile_marks import constant_under_compile


@constant_under_compile  # not traced: the import inside
def triton_available() -> bool:
    return _triton_imports() is None


@functools.cache
def _triton_imports() -> str | None:
    """None when triton imports, else why not (its CPU interpreter imports numpy, which triton does not
    depend on: with TRITON_INTERPRET=1 and no numpy, an installed triton fails to import)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install on a CPU-only box
        return f"{type(e).__name__}: {e}"
    return None


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether `auto` should pick the triton backend for tensors on this device (CUDA only:
    on the CPU triton runs only under its interpreter, which CI asks for explicitly)."""
    return t.is_cuda and triton_available()


@constant_under_compile  # torch.compile cannot trace triton's knob (an environment read)
def _triton_interprets() -> bool:
    """Whether triton runs kernels in its CPU interpreter (its own setting, read through triton)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def triton_can_run_on(t: torch.Tensor) -> bool:
    """Whether triton kernels can run on `t` at all: triton installed, and t on CUDA, or on the CPU
    under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported; how CI runs them)."""
    return triton_available() and (t.is_cuda or (t.device.type == "cpu" and _triton_interprets()))


def require_triton_on(t: torch.Tensor) -> None:
    """Raise a clear error when backend="triton" is asked for where its kernels cannot run:
    triton not installed, or a tensor off CUDA without Triton's CPU interpreter."""
    if not triton_available():
        raise ValueError(
            f"backend='triton' needs triton installed and importable, and it did not import ({_triton_imports()}): "
            "pip install triton, and numpy for Triton's CPU interpreter; use backend='auto' or 'reference'"
        )
    if triton_can_run_on(t):
        return
    raise ValueError(
        f"backend='triton' got a tensor on device={t.device}: the triton kernels run on CUDA devices, or on "
        "the CPU only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported); "
        "use backend='auto' or 'reference' here"
    )


# The kernels load these and compute in fp32 (fp32 dots in IEEE precision): anything wider,
# float64 above all, would silently lose precision, so it is refused or left to torch.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_takes_dtype(t: torch.Tensor) -> bool:
    """Whether the triton kernels compute on `t` at its own precision: fp32, bf16 or fp16 data.
    Integer tensors (expert ids, the route map's indices) are index data and always pass."""
    return t.dtype in TRITON_DTYPES or not (t.dtype.is_floating_point or t.dtype.is_complex)


def use_triton(backend: str, t: torch.Tensor) -> bool:
    """Whether a call with this backend runs the triton kernels on `t` (one rule for every op):
    "triton" always (after `require_triton_on`), "auto" on CUDA when installed. `t` is the data
    the op computes on; data in a dtype the kernels do not take (float64, fp8, complex) is
    refused by "triton" and sent by "auto" to the torch / reference path, exact in its dtype.
    Any other name than auto / triton / torch / reference is refused here, for every op."""
    if backend not in ("auto", "triton", "torch", "reference"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'triton', 'torch', 'reference'")
    if backend == "triton":
        if not triton_takes_dtype(t):
            raise ValueError(
                f"backend='triton' got dtype={t.dtype}: the triton kernels take "
                f"{', '.join(str(d) for d in TRITON_DTYPES)} (they compute in fp32); "
                "use backend='auto' or 'reference' for other dtypes"
            )
        require_triton_on(t)
        return True
    return backend == "auto" and triton_takes_dtype(t) and triton_runs_on(t)


def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with the row-major strides torch's grouped_mm and the kernels expect. `.contiguous()` alone
    is not enough: a tensor with no elements counts as contiguous whatever its strides, and the
    gradient of `out.sum()` for an empty `out` is an expanded tensor with stride 0, which
    grouped_mm refuses ("Invalid strides/sizes"); so does a dim of size 1, whatever its stride
    (a single row `x.T` of a [d, 1] column has row stride 1, which grouped_mm refuses, "strides
    should be multiple of 16 bytes", as it refuses offsets [1] with a stride other than 1)."""
    step, standard = 1, []
    for n in reversed(t.shape):
        standard.insert(0, step)
        step *= max(n, 1)
    if t.numel() == 0 or t.stride() != tuple(standard):  # a clone (differentiable) gets the standard strides
        return t.clone(memory_format=torch.contiguous_format)
    return t


def at_own_dtype(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context in which torch's matmuls on `t` compute in its own dtype, whatever torch.autocast
    says: every op here computes in the dtype it is given, as the triton kernels (which autocast
    never touches) do. Under autocast a per-expert `x @ w` would return bf16 rows that then meet
    the fp32 weights of the next GEMM, and combine's fp32 sum would run as a bf16 bmm."""
    # (torch.compile cannot trace the availability check in torch 2.11; it traces only devices that have autocast)
    if torch.compiler.is_compiling() or torch.amp.is_autocast_available(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def refuse_double_backward(op: str) -> None:
    """Called first in the backward of every triton autograd Function. Their backward kernels build
    no autograd graph, so torch.autograd.grad(..., create_graph=True) (a gradient penalty, a Hessian
    product) would silently get gradients with no second-order term; grad mode is on during a
    backward only when a graph of it is being built."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op}: the triton backend's backward is not differentiable (create_graph=True asks for a second "
            "derivative); use backend='reference' for higher-order gradients (on a GPU, backend='torch' and 'auto' run "
            "this Triton op too)"
        )
