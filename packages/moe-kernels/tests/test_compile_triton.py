"""torch.compile(fullgraph=True) over the triton backend, on the CPU through Triton's interpreter.

Under torch.compile the triton ops run as torch.library custom ops (`moe_kernels/triton/compile_ops.py`): dynamo
could not trace the kernels' launchers (on a GPU it raised an internal error inside triton's launcher with
backend="triton", and broke the graph four times with "auto"). Each check compiles a block with fullgraph=True, so
any graph break fails it, and compares the output and every gradient with eager's (fp32: the interpreter
mishandles bf16). The GPU side, with "auto"'s plan chosen when the op runs, is tests/test_compile_gpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import interpreter_checks  # noqa: E402

try:
    import numpy  # noqa: F401  (Triton's interpreter runs on numpy)
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False


def _operands(torch, T, d, h, E, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).requires_grad_()
    router_w = (torch.randn(d, E, generator=g) * d**-0.5).requires_grad_()
    w1 = (torch.randn(E, d, 2 * h, generator=g) * d**-0.5).requires_grad_()
    w2 = (torch.randn(E, h, d, generator=g) * h**-0.5).requires_grad_()
    return [x, router_w, w1, w2]


def _compare(torch, fn, args, *extra, compiler="aot_eager"):
    """fn compiled with fullgraph=True against fn eager: the output and the gradient of every input that wants one.
    dynamo + AOTAutograd (the custom ops, their fakes and backward) unless `compiler` says inductor: its C++ builds
    cost seconds a graph on 2 cores, and one check through it (the fused block) is enough for the lowering."""
    import torch._dynamo

    wants = [a for a in args if a.requires_grad]
    want = fn(*args, *extra)
    want_grads = torch.autograd.grad(want.square().sum(), wants)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=compiler)(*args, *extra)
    got_grads = torch.autograd.grad(got.square().sum(), wants)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"gradient {i}: {m}")


def _fused(x, router_w, w1, w2, k):
    import moe_kernels as moe

    weights, ids = (x @ router_w).softmax(-1).topk(k, dim=-1)
    rm = moe.build_route_map(ids, w1.shape[0], backend="triton")
    return moe.moe_ffn(x, rm, weights, w1, w2, backend="triton")


def _composed(x, router_w, w1, w2, k):
    import moe_kernels as moe

    weights, ids = (x @ router_w).softmax(-1).topk(k, dim=-1)
    rm = moe.build_route_map(ids, w1.shape[0], backend="triton")
    y = moe.swiglu_experts(moe.permute(x, rm, backend="triton"), w1, w2, rm.offsets, backend="triton")
    return moe.combine(y, rm, weights, backend="triton")


def check_fused_block_with_empty_experts(torch, moe):
    """37 tokens, top-2 over 24 experts: some experts get no row."""
    _compare(torch, _fused, _operands(torch, 37, 16, 8, 24, 0), 2, compiler="inductor")


def check_composed_block(torch, moe):
    """permute -> swiglu_experts (rows already in expert order) -> combine."""
    _compare(torch, _composed, _operands(torch, 29, 16, 12, 5, 1), 3)


def check_frozen_expert_weights_and_rows(torch, moe):
    """Gradients only where asked: frozen w1 and x (a block whose input comes from a frozen part)."""
    args = _operands(torch, 19, 16, 8, 4, 2)
    args[0].requires_grad_(False)
    args[2].requires_grad_(False)
    _compare(torch, _fused, args, 2)


def check_grouped_gemm(torch, moe):
    """The grouped GEMM alone on rows in expert order, uneven counts with an empty expert."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(23, 16, generator=g).requires_grad_()
    w = torch.randn(4, 16, 24, generator=g).requires_grad_()
    offsets = torch.tensor([5, 5, 17, 23], dtype=torch.int32)
    _compare(torch, lambda x, w: moe.grouped_gemm(x, w, offsets, backend="triton"), [x, w])


def check_no_graph_break_and_one_graph(torch, moe):
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(_fused)(*_operands(torch, 11, 16, 8, 3, 4), 2)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained


CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


@pytest.mark.skipif(not HAVE_TRITON, reason="triton or numpy (its interpreter needs it) is not installed")
@pytest.mark.parametrize("check", list(CHECKS))
def test_torch_compile_fullgraph_through_triton_under_interpreter(interpreter_verdicts, check):
    assert interpreter_verdicts[check]["verdict"] == "ok", interpreter_verdicts[check]["verdict"]


if __name__ == "__main__":
    import torch

    import moe_kernels as moe

    interpreter_checks.run_checks(CHECKS, torch, moe)
