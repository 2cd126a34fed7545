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

from moe_kernels.triton import refuse_double_backward


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


def _second_derivative_error(op: str) -> RuntimeError:
    return RuntimeError(
        f"{op}: the triton backend's backward is not differentiable (a second derivative: create_graph=True, "
        "nested torch.func.grad, hessian); backend='triton' cannot give one: use backend='reference' "
        "for higher-order gradients (on a GPU, backend='torch' and 'auto' run this Triton op too)"
    )


def forward_ad_error(op: str) -> RuntimeError:
    return RuntimeError(
        f"{op}: forward-mode AD (torch.func.jvp, jacfwd, hessian, linearize; torch.autograd.forward_ad's dual "
        "tensors) is not supported with backend='triton'; use backend='reference' for that transform (on a GPU, "
        "backend='torch' and 'auto' run this Triton op too)"
    )


def refuse_dual_inputs(op: str, inputs: tuple) -> None:
    """Called first in the forward of every triton autograd Function: dual tensors of
    torch.autograd.forward_ad (which torch.func.linearize traces with make_fx) are refused by name
    before a kernel launch, where torch would only say that a jvp staticmethod is missing (and
    linearize fails inside Triton's launcher). The forward, not setup_context: linearize traces the
    forward, whose kernels cannot take its proxy tensors, before setup_context would run."""
    if not torch.compiler.is_compiling() and _has_forward_grad(inputs):
        raise forward_ad_error(op)


def refuse_forward_ad(op: str) -> None:
    """Called in the setup_context of every triton autograd Function: under torch.func's jvp transform
    (jvp, jacfwd, hessian) raise the error naming the backend, where torch would only say that a jvp
    staticmethod is missing. Not a jvp staticmethod that raises: torch.compile breaks the graph at
    any Function that defines one."""
    if torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active():
        return
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    if retrieve_current_functorch_interpreter().key() == TransformType.Jvp:
        raise forward_ad_error(op)


def _has_forward_grad(inputs: tuple) -> bool:
    """Whether an input is a dual tensor of the current torch.autograd.forward_ad level (only
    inside a `dual_level()`: outside one, no tensor carries a tangent). A Function's forward may
    run with forward grad disabled, which hides the tangents from unpack_dual: enabled for the look."""
    import torch.autograd.forward_ad as fwAD

    if fwAD._current_level < 0:
        return False
    with fwAD._set_fwd_grad_enabled(True):
        return any(isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None for t in inputs)


def _legacy_batched_error(op: str) -> RuntimeError:
    return RuntimeError(
        f"{op}: backend='triton' cannot run its backward under torch.autograd.grad(..., is_grads_batched=True) "
        "(nor torch.autograd.functional.jacobian / hessian with vectorize=True): torch batches that backward "
        "with its legacy vmap, whose tensors the triton kernels cannot read; use torch.func.jacrev or "
        "torch.func.vmap over torch.func.vjp's vjp_fn, vectorize=False, or backend='reference'"
    )


def _plain(t):
    """The tensor a kernel can read: torch.func's gradient wrappers outlive their transform (a vjp_fn
    called after torch.func.vjp returned holds dead ones), and only their inner tensor has storage."""
    if isinstance(t, torch.Tensor):
        return torch._C._functorch.unwrap_if_dead(t)
    return t


def in_func_transform(*tensors) -> bool:
    """Whether a backward runs inside a torch.func transform (or on the tensors of one, such as a
    vjp_fn's): its inputs are then functorch wrappers, which the kernels cannot read directly."""
    if torch._C._are_functorch_transforms_active():
        return True
    return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def vmap_by_loop(info, in_dims, fn, *args):
    """A vmap rule for the triton ops: one call of `fn` per sample, outputs stacked on dim 0 (None
    outputs stay None). Index tensors are made contiguous per sample: the kernels read them flat."""
    outs = []
    for i in range(info.batch_size):
        sample = []
        for a, d in zip(args, in_dims):
            if isinstance(a, torch.Tensor) and d is not None:  # a tuple argument's dims are a tuple of Nones
                a = a.select(d, i)
                a = a if a.is_floating_point() else a.contiguous()
            sample.append(a)
        outs.append(fn(*sample))
    if not isinstance(outs[0], tuple):
        return torch.stack(outs), 0
    stacked = tuple(None if o[0] is None else torch.stack(list(o)) for o in zip(*outs))
    return stacked, tuple(None if o is None else 0 for o in stacked)


class KernelBackward(torch.autograd.Function):
    """A triton backward run inside torch.func: `fn(*args)` on the tensors under functorch's wrappers,
    as one op that vmap runs sample by sample (vmap of grad, jacrev). Differentiating it again
    raises, so a second derivative is refused when it is asked for, not silently wrong; a plain
    torch.func.grad / vjp builds the graph of its backward (create_graph=True) but never walks it."""

    @staticmethod
    def forward(fn, op, *args):
        return fn(*[_plain(a) for a in args])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op = inputs[1]

    @staticmethod
    def backward(ctx, *grads):
        raise _second_derivative_error(ctx.op)

    @staticmethod
    def jvp(ctx, *tangents):
        raise forward_ad_error(ctx.op)  # only ever applied inside torch.func: no torch.compile to spare

    @staticmethod
    def vmap(info, in_dims, fn, op, *args):
        # per sample through apply: an autograd graph below the vmap gets the refusing node too
        return vmap_by_loop(info, in_dims[2:], lambda *a: KernelBackward.apply(fn, op, *a), *args)


def run_backward(op: str, fn, *args):
    """A triton Function's backward: `fn(*args)` directly in eager autograd (refusing create_graph=True
    there, as always), through KernelBackward inside torch.func."""
    if not torch.compiler.is_compiling():
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if in_func_transform(*tensors):
            return KernelBackward.apply(fn, op, *args)
        if any(torch._C._functorch.is_legacy_batchedtensor(t) for t in tensors):
            raise _legacy_batched_error(op)
    refuse_double_backward(op)
    return fn(*args)


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
