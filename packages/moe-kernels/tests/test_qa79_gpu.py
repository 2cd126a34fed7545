"""QA 79 on a GPU: torch.compile over moe-kernels with token counts that change every step, and CUDA graphs.

bf16, backends auto / triton / torch. A dropless MoE layer sees another token count each step: marking T dynamic
keeps one graph, and plain compile makes T dynamic after its first recompile (before QA 79 the route map and two
messages specialised T, so every count compiled a new graph and the 9th raised FailOnRecompileLimitHit under
fullgraph). mode="reduce-overhead" (CUDA graphs) replays the block with eager's output and gradients.

Run on the device: PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 -m pytest -m gpu packages/moe-kernels/tests/test_qa79_gpu.py
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import moe_kernels as moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D, H, E, K = 128, 64, 16, 2


def block(x, router_w, w1, w2, backend):
    weights, ids = (x.float() @ router_w).softmax(-1).topk(K, dim=-1)
    rm = moe.build_route_map(ids, w1.shape[0])
    return moe.moe_ffn(x, rm, weights, w1, w2, backend=backend)


def params(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    router_w = (torch.randn(D, E, device="cuda", generator=g) * D**-0.5).requires_grad_()
    w1 = (torch.randn(E, D, 2 * H, device="cuda", generator=g) * D**-0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, D, device="cuda", generator=g) * H**-0.5).bfloat16().requires_grad_()
    return [router_w, w1, w2]


def tokens(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def out_and_grads(fn, x, ps, backend):
    out = fn(x, *ps, backend)
    return [out.detach().clone(), *(g.clone() for g in torch.autograd.grad(out.float().square().mean(), [x, *ps]))]


def assert_close_rel(got, want, what):
    for name, a, b in zip(("out", "x", "router_w", "w1", "w2"), got, want):
        assert rel(a, b) <= 1e-2, (what, name, rel(a, b))


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_marked_dynamic_token_count_keeps_one_graph(backend):
    ps = params(0)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, fullgraph=True)
    for i, T in enumerate((301, 517, 64)):
        x = tokens(T, i)
        want = out_and_grads(block, x, ps, backend)
        torch._dynamo.mark_dynamic(x, 0)
        assert_close_rel(out_and_grads(compiled, x, ps, backend), want, f"T={T}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_plain_compile_over_ten_token_counts_recompiles_once(backend):
    ps = params(1)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, fullgraph=True)
    for T in range(200, 210):
        x = tokens(T, T)
        assert_close_rel(out_and_grads(compiled, x, ps, backend), out_and_grads(block, x, ps, backend), f"T={T}")
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_reduce_overhead_cuda_graphs_replay_eager_numbers(backend):
    """Forward + backward through CUDA graph trees: warm-up runs (auto times its plan there), then replays on new
    data copied into the same shapes give eager's output and gradients."""
    ps = params(2)
    torch._dynamo.reset()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        x = tokens(256, 10 + step)
        got = out_and_grads(compiled, x, ps, backend)
        torch.cuda.synchronize()
        assert_close_rel(got, out_and_grads(block, x, ps, backend), f"step {step}")
