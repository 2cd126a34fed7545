"""torch.func support shared by the Triton backend's autograd Functions: a vmap rule that runs a
kernel once per sample, a backward that runs inside torch.func's transforms (and refuses to be
differentiated again), and the refusals of what the kernels cannot give (forward-mode AD, second
derivatives, torch.autograd's legacy batched backward), each naming backend='reference'."""

from __future__ import annotations

import torch

from moe_kernels.forward_ad import has_forward_grad
from moe_kernels.triton import refuse_double_backward


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
    if has_forward_grad(inputs):
        raise forward_ad_error(op)


def refuse_forward_ad(op: str) -> None:
    """Called in the setup_context of every triton autograd Function: under torch.func's jvp transform
    (jvp, jacfwd, hessian) raise the error naming the backend, where torch would only say that a jvp
    staticmethod is missing. Not a jvp staticmethod that raises: torch.compile breaks the graph at
    any Function that defines one."""
    if not torch._C._are_functorch_transforms_active():
        return
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    if retrieve_current_functorch_interpreter().key() == TransformType.Jvp:
        raise forward_ad_error(op)


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
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if in_func_transform(*tensors):
        return KernelBackward.apply(fn, op, *args)
    if any(torch._C._functorch.is_legacy_batchedtensor(t) for t in tensors):
        raise _legacy_batched_error(op)
    refuse_double_backward(op)
    return fn(*args)
