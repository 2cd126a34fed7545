"""torch.compile(fullgraph=True) traces a whole MoE block on the CPU.

The CPU checks of expert ids and offsets branched on tensor data (`bool(bad.any())`,
`offsets.tolist()`), and the torch backend fixed its gradient's strides in a tensor hook that
branches on them: dynamo refused all three under fullgraph=True. Under tracing the checks are
asserts inside the graph, and the stride fix is an autograd.Function.
"""

import pytest
import torch

from moe_kernels import build_route_map, combine, moe_ffn, permute, swiglu_experts


def _block(x, logits, w1, w2, k, backend):
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    rm = build_route_map(ids, w1.shape[0])
    fused = moe_ffn(x, rm, weights, w1, w2, backend=backend)
    composed = combine(swiglu_experts(permute(x, rm), w1, w2, rm.offsets, backend=backend), rm, weights)
    return fused + composed


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_block_compiles_whole_and_matches_eager(backend):
    gen = torch.Generator().manual_seed(7)
    T, d, h, E, k = 37, 32, 16, 8, 2  # T odd; with 37 tokens over 8 experts some may be empty
    x = torch.randn(T, d, generator=gen, requires_grad=True)
    w1 = (torch.randn(E, d, 2 * h, generator=gen) * d**-0.5).requires_grad_()
    w2 = (torch.randn(E, h, d, generator=gen) * h**-0.5).requires_grad_()
    logits = torch.randn(T, E, generator=gen, requires_grad=True)
    params = (x, w1, w2, logits)

    eager = _block(x, logits, w1, w2, k, backend)
    eager_grads = torch.autograd.grad(eager.square().sum(), params)
    compiled = torch.compile(_block, fullgraph=True)(x, logits, w1, w2, k, backend)
    compiled_grads = torch.autograd.grad(compiled.square().sum(), params)

    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("x", "w1", "w2", "logits"), compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"d{name}")


def test_compiled_route_map_still_refuses_out_of_range_ids():
    offsets = torch.compile(lambda ids: build_route_map(ids, 8).offsets, fullgraph=True)
    assert offsets(torch.tensor([[1, 2], [2, 7]])).tolist() == [0, 1, 3, 3, 3, 3, 3, 4]
    with pytest.raises(RuntimeError, match=r"outside \[0, num_experts=8\)"):
        offsets(torch.tensor([[1, 2], [2, 8]]))
