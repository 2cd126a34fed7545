"""Marks that tell torch.compile how to treat a function, set without importing torch._dynamo.

`import moe_kernels` must not import torch._dynamo (seconds of import, and a process group made after it would keep
gloo threads alive; moe-parallel's test_object_lifetime), so the marks are the attributes dynamo reads, set by hand.
"""

from __future__ import annotations


def constant_under_compile(fn):
    """Mark `fn` as torch.compiler.assume_constant_result does (torch 2.11 to 2.15 set this attribute, which dynamo
    reads): torch.compile runs it for real while tracing and takes its result as a constant. tests/
    test_compile_triton.py fails if dynamo stops honouring the mark (a graph break at the interpreter check)."""
    fn._dynamo_marked_constant = True
    return fn
