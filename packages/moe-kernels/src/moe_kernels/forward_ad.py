"""Whether forward-mode AD reaches an op: torch.func's jvp transform anywhere in the stack of active transforms
(jvp, jacfwd, hessian), or dual tensors of torch.autograd.forward_ad among its inputs (which torch.func.linearize
makes too). The backends whose kernels have no forward derivative ask this to refuse it by name (backend='torch',
'triton'), or to take the reference path instead (backend='auto' on the CPU)."""

from __future__ import annotations

import torch


def forward_ad_active(inputs: tuple) -> bool:
    """Whether an op called now on these inputs would be differentiated in forward mode. False under
    torch.compile's trace, where the transforms are not visible (and do not run together with compile)."""
    if torch.compiler.is_compiling():
        return False
    return jvp_transform_active() or has_forward_grad(inputs)


def jvp_transform_active() -> bool:
    """Whether any active torch.func transform is a jvp (jacfwd and hessian run one outside vmap or grad)."""
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(interpreter.key() == TransformType.Jvp for interpreter in retrieve_all_functorch_interpreters())


def has_forward_grad(inputs: tuple) -> bool:
    """Whether an input is a dual tensor of the current torch.autograd.forward_ad level (only
    inside a `dual_level()`: outside one, no tensor carries a tangent). A Function's forward may
    run with forward grad disabled, which hides the tangents from unpack_dual: enabled for the look."""
    import torch.autograd.forward_ad as fwAD

    if fwAD._current_level < 0:
        return False
    with fwAD._set_fwd_grad_enabled(True):
        return any(isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None for t in inputs)
