"""AllToAllDispatcher on an NCCL group of one GPU against LocalDispatcher: outputs, gradients, capacity drops and the
refusal paths.

Every other AllToAllDispatcher test runs on gloo, which takes CPU tensors and has no streams. NCCL takes only CUDA
tensors: the count exchange, the error-text gather of a refused call and the header built for a rank whose inputs
were refused must all be on the GPU. One GPU gives a group of one rank (NCCL refuses two ranks on one device), so
the exchange moves rows to itself, but through the same NCCL calls as on several GPUs.

Run on the device: PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 -m pytest -m gpu \
    packages/moe-kernels/tests/test_all_to_all_nccl_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_kernels import AllToAllDispatcher, LocalDispatcher, build_route_map, swiglu_experts

sys.path.insert(0, str(Path(__file__).parent))
from fp8_codec import Fp8Codec  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def nccl_group():
    assert not dist.is_initialized(), "another test left a default process group behind"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def block(x, ids, weights, w1, w2, dispatcher, backend):  # noqa: ANN001, ANN201
    result = dispatcher.dispatch(x, build_route_map(ids, w1.shape[0]))
    out = swiglu_experts(result.rows, w1, w2, result.offsets, backend)
    return dispatcher.combine(out, result, weights), result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("capacity", [0.0, 0.5])
def test_nccl_dispatch_matches_the_local_dispatcher(nccl_group, dtype, backend, capacity):
    """T=333 tokens, top-3 of 12 experts with experts 2 and 7 empty; at capacity 0.5 the last half of the
    expert-order rows is dropped, which the local reference reproduces by zeroing those slots' weights."""
    g = torch.Generator().manual_seed(7)
    T, d, h, E, k = 333, 72, 40, 12, 3
    allowed = torch.tensor([e for e in range(E) if e not in (2, 7)])
    ids = allowed[torch.rand(T, len(allowed), generator=g).topk(k, dim=1).indices].cuda()
    x0 = torch.randn(T, d, generator=g).to("cuda", dtype)
    w0 = torch.rand(T, k, generator=g).to("cuda", dtype)
    a0 = (torch.randn(E, d, 2 * h, generator=g) / d**0.5).to("cuda", dtype)
    b0 = (torch.randn(E, h, d, generator=g) / h**0.5).to("cuda", dtype)
    probe = torch.randn(T, d, generator=g).to("cuda", dtype)

    def run(dispatcher, keep=None):  # noqa: ANN001, ANN202
        x, w, a, b = (t.clone().requires_grad_() for t in (x0, w0, a0, b0))
        out, result = block(x, ids, w if keep is None else w * keep, a, b, dispatcher, backend)
        (out.float() * probe.float()).sum().backward()
        return out.detach(), result, x.grad, w.grad, a.grad, b.grad

    a2a = AllToAllDispatcher(nccl_group, E, capacity_factor=capacity)
    got = run(a2a)
    keep = None
    if capacity:
        cap = int(capacity * T * k + 0.999999)
        route_map = build_route_map(ids, E)
        expert_order_row = route_map.dest_row.view(T, k)  # the row each (token, slot) takes in expert order
        keep = (expert_order_row < cap).to(dtype)
        assert int(got[1].dropped) == T * k - cap and got[1].rows.shape[0] == cap
    want = run(LocalDispatcher(E), keep)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g_, w_ in zip(("out", "dx", "dweights", "dw1", "dw2"), got[:1] + got[2:], want[:1] + want[2:]):
        if name == "dweights" and keep is not None:  # a dropped slot's weight gets no gradient on either side
            g_, w_ = g_ * keep, w_ * keep
        err = float((g_.float() - w_.float()).norm() / w_.float().norm().clamp_min(1e-30))
        assert err < tol, (name, err)
    assert got[1].rows.is_cuda and got[1].offsets.is_cuda and got[1].offsets.dtype == torch.int32


def test_refused_dispatch_and_combine_raise_their_own_error_over_nccl(nccl_group):
    """A route map over another number of experts (refused after the count exchange, the error texts gathered as
    CUDA bytes) and expert rows of another count: each raises the rank's own error, and the dispatcher still works."""
    E, T, d, k = 8, 50, 16, 2
    ids = torch.randint(0, E, (T, k), device="cuda")
    x = torch.randn(T, d, device="cuda")
    a2a = AllToAllDispatcher(nccl_group, E)
    with pytest.raises(ValueError, match="route map has 16 experts, dispatcher expects 8") as info:
        a2a.dispatch(x, build_route_map(torch.randint(0, 16, (T, k), device="cuda"), 16))
    assert "dispatch stopped on every EP rank before any row moved" in "".join(getattr(info.value, "__notes__", []))
    result = a2a.dispatch(x, build_route_map(ids, E))
    with pytest.raises(ValueError, match=r"expert_out has 101 rows, dispatch handed out N_kept=100"):
        a2a.combine(torch.randn(T * k + 1, d, device="cuda"), result, torch.rand(T, k, device="cuda"))
    # the group is still usable: a good call after the two refusals
    out = a2a.combine(result.rows, result, torch.ones(T, k, device="cuda"))
    assert torch.allclose(out, x * k)


def test_an_fp8_payload_over_nccl_equals_the_local_dispatcher_with_the_same_codec(nccl_group):
    """The same fp8 rounding both ways (forward rows and their gradients), so equal to fp32 rounding."""
    g = torch.Generator().manual_seed(11)
    T, d, h, E, k = 97, 64, 40, 8, 2
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.cuda()
    x0, w0 = torch.randn(T, d, generator=g).cuda(), torch.rand(T, k, generator=g).cuda()
    a0, b0 = torch.randn(E, d, 2 * h, generator=g).cuda() / d**0.5, torch.randn(E, h, d, generator=g).cuda() / h**0.5
    probe = torch.randn(T, d, generator=g).cuda()

    def run(dispatcher):  # noqa: ANN001, ANN202
        x, w, a, b = (t.clone().requires_grad_() for t in (x0, w0, a0, b0))
        out, result = block(x, ids, w, a, b, dispatcher, "reference")
        (out * probe).sum().backward()
        assert result.rows.dtype == torch.float32  # decoded on arrival
        return out.detach(), x.grad, w.grad, a.grad, b.grad

    got, want = run(AllToAllDispatcher(nccl_group, E, codec=Fp8Codec())), run(LocalDispatcher(E, codec=Fp8Codec()))
    for name, g_, w_ in zip(("out", "dx", "dweights", "dw1", "dw2"), got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5, msg=name)
    plain = run(LocalDispatcher(E))
    assert not torch.equal(got[0], plain[0])  # the rows did travel as fp8
