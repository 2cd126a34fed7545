"""cast_weight under a double backward (create_graph): the second-order term through the cast survives."""

import torch

from moe_precision import cast


def test_cast_weight_double_backward_matches_to_whatever_the_fast_upcast_records(monkeypatch):
    """On CUDA the gradient's cast back runs a Triton kernel, which autograd does not see: under create_graph
    (Hessian-vector products, gradient penalties) the weight gradient came back without a graph and the
    second-order term through the cast was silently dropped. Here `upcast` is replaced by a cast that records
    nothing, as that kernel's output, so the CPU shows what the GPU did."""
    calls = []
    monkeypatch.setattr(cast, "upcast", lambda t, dtype: calls.append(1) or t.detach().to(dtype))
    g = torch.Generator().manual_seed(0)
    x, v, w0 = torch.randn(5, 4, generator=g), torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)

    def grad_and_hvp(to_bf16):
        w = w0.clone().requires_grad_()
        loss = (x.bfloat16() @ to_bf16(w)).float().pow(3).sum()
        grad, = torch.autograd.grad(loss, w, create_graph=True)
        return grad, torch.autograd.grad((grad * v).sum(), w)[0]

    (g1, h1), (g2, h2) = grad_and_hvp(lambda w: cast.cast_weight(w, torch.bfloat16)), grad_and_hvp(lambda w: w.bfloat16())
    assert torch.equal(g1, g2)
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)
    calls.clear()  # a plain backward still takes the fast cast
    w = w0.clone().requires_grad_()
    (x.bfloat16() @ cast.cast_weight(w, torch.bfloat16)).float().sum().backward()
    assert calls == [1] and w.grad.dtype == torch.float32
