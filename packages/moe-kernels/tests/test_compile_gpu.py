"""torch.compile over moe-kernels on a GPU, as another training stack that compiles its model uses it.

Every backend under fullgraph=True (no graph break: the triton ops are custom ops under compile), bf16, the fused
block and the composed ops, on a small odd shape with empty experts: compiled output and gradients against eager's.
"auto" chooses its plan when the compiled op first runs (the trace has no data to time) and caches it as eager does.

Run on the device: PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 -m pytest -m gpu packages/moe-kernels/tests/test_compile_gpu.py
"""

import pytest
import torch
import torch._dynamo

import moe_kernels as moe
from moe_kernels import expert_ffn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def fused(x, router_w, w1, w2, k, backend):
    weights, ids = (x.float() @ router_w).softmax(-1).topk(k, dim=-1)
    rm = moe.build_route_map(ids, w1.shape[0])
    return moe.moe_ffn(x, rm, weights, w1, w2, backend=backend)


def composed(x, router_w, w1, w2, k, backend):
    weights, ids = (x.float() @ router_w).softmax(-1).topk(k, dim=-1)
    rm = moe.build_route_map(ids, w1.shape[0])
    y = moe.swiglu_experts(moe.permute(x, rm), w1, w2, rm.offsets, backend=backend)
    return moe.combine(y, rm, weights)


def operands(T, d, h, E, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, d, device="cuda", generator=g).bfloat16().requires_grad_()
    router_w = (torch.randn(d, E, device="cuda", generator=g) * d**-0.5).requires_grad_()
    w1 = (torch.randn(E, d, 2 * h, device="cuda", generator=g) * d**-0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, h, d, device="cuda", generator=g) * h**-0.5).bfloat16().requires_grad_()
    return [x, router_w, w1, w2]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
@pytest.mark.parametrize("block", [fused, composed], ids=["fused", "composed"])
def test_compiled_fullgraph_block_matches_eager(block, backend):
    """301 tokens, top-2 over 48 experts (some empty), d=128, h=64: the same kernels run, so the output is eager's
    to bf16 rounding of the elementwise ops inductor fuses around them (the router softmax / top-k)."""
    args = operands(301, 128, 64, 48, seed=0)
    want = block(*args, 2, backend)
    want_grads = torch.autograd.grad(want.float().square().mean(), args)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    for _ in range(2):  # compiling (and for auto, timing the plan when the op first runs), then the graph alone
        got = compiled(*args, 2, backend)
        got_grads = torch.autograd.grad(got.float().square().mean(), args)
        assert rel(got, want) <= 1e-2
        for name, a, b in zip(("x", "router_w", "w1", "w2"), got_grads, want_grads):
            assert rel(a, b) <= 1e-2, (name, rel(a, b))


def test_auto_under_compile_runs_and_caches_the_plan_eager_runs():
    """The plan the compiled op chooses is the one eager then finds in the cache (one tuning for both)."""
    expert_ffn._PLANS.clear()
    args = operands(512, 256, 128, 16, seed=1)
    torch._dynamo.reset()
    torch.compile(fused, fullgraph=True)(*args, 4, "auto").float().sum().backward()
    assert len(expert_ffn.tuned_plans()) == 1
    plans = dict(expert_ffn.tuned_plans())
    fused(*args, 4, "auto").float().sum().backward()
    assert expert_ffn.tuned_plans() == plans
