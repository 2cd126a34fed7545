"""QA 50: moe-kernels as a library inside another training stack, on the CPU.

torch.func (grad, vmap of grad, jacrev) through the block on the default CPU path: torch's grouped_mm
runs behind a small autograd.Function of the old ctx-in-forward form, which torch.func refuses. A
payload codec that returns other rows than T*k, or that cuts the autograd graph, is refused by name
(the local dispatcher took any payload, and a graph-cutting codec silently left x without the
experts' gradient, on one device and over expert parallelism alike). Expert ids passed where the
route map goes, or a list / numpy array where a tensor goes, raise a TypeError naming the argument
(an AttributeError from deep inside before).
"""

import sys
from pathlib import Path

import pytest
import torch

from moe_kernels import (
    AllToAllDispatcher,
    LocalDispatcher,
    build_route_map,
    combine,
    grouped_gemm,
    moe_ffn,
    permute,
    swiglu_experts,
)

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402

T, D, H, E, K = 6, 8, 4, 5, 2  # fp32 rows of 32 and 16 bytes: torch's grouped_mm takes both


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    x = torch.randn(T, D, generator=g)
    weights = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, D, 2 * H, generator=g) * D**-0.5
    w2 = torch.randn(E, H, D, generator=g) * H**-0.5
    return build_route_map(ids, E), [x, weights, w1, w2]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_torch_func_grad_vmap_and_jacrev_run_through_the_block(backend):
    rm, leaves = _inputs()
    xs = [t.clone().requires_grad_() for t in leaves]
    want = torch.autograd.grad(moe_ffn(xs[0], rm, xs[1], xs[2], xs[3], backend).square().sum(), xs)

    def loss(x, weights, w1, w2):
        return moe_ffn(x, rm, weights, w1, w2, backend).square().sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2, 3))(*leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # per-copy gradients of the down projection (vmap of grad), and the Jacobian in the router weights
    w2s = torch.stack([leaves[3], 2 * leaves[3]])
    per_copy = torch.func.vmap(torch.func.grad(lambda w2: loss(leaves[0], leaves[1], leaves[2], w2)))(w2s)
    torch.testing.assert_close(per_copy[0], want[3], rtol=1e-5, atol=1e-5)
    jac = torch.func.jacrev(lambda w: moe_ffn(leaves[0], rm, w, leaves[2], leaves[3], backend))(leaves[1])
    out = moe_ffn(leaves[0], rm, leaves[1], leaves[2], leaves[3], backend)
    # the block is linear in the router weights: out = J . weights
    torch.testing.assert_close(torch.einsum("tdsk,sk->td", jac, leaves[1]), out, rtol=1e-5, atol=1e-5)


class _DropsARow:
    def encode(self, rows):
        return rows[:-1]

    def decode(self, payload):
        return payload


class _Tuple:
    def encode(self, rows):
        return rows, rows.shape

    def decode(self, payload):
        return payload[0]


class _DecodesARowShort:
    def encode(self, rows):
        return rows

    def decode(self, payload):
        return payload[:-1]


class _Decodes3D:
    def encode(self, rows):
        return rows

    def decode(self, payload):
        return payload.unsqueeze(1)


class _BitPattern:
    """fp32 rows travel as their int32 bit pattern with no autograd Function around it: the graph is cut."""

    def encode(self, rows):
        return rows.detach().view(torch.int32)

    def decode(self, payload):
        return payload.view(torch.float32)


class _Bf16:
    """A lossy cast: autograd follows it."""

    def encode(self, rows):
        return rows.to(torch.bfloat16)

    def decode(self, payload):
        return payload.to(torch.float32)


@pytest.mark.parametrize(
    "codec, match",
    [
        (_DropsARow(), r"codec.encode must return a tensor of T\*k=12 rows, got \(11, 8\)"),
        (_Tuple(), r"codec.encode must return a tensor of T\*k=12 rows, got tuple"),
        (_DecodesARowShort(), r"codec.decode must return the \[T\*k=12, d\] rows .* got \(11, 8\)"),
        (_Decodes3D(), r"codec.decode must return the \[T\*k=12, d\] rows .* got \(12, 1, 8\)"),
    ],
)
def test_local_dispatcher_refuses_a_codec_that_returns_other_rows(codec, match):
    rm, (x, *_) = _inputs()
    with pytest.raises(ValueError, match=match):
        LocalDispatcher(E, codec).dispatch(x, rm)


def test_local_dispatcher_refuses_a_codec_that_cuts_x_off_the_graph():
    rm, (x, weights, w1, w2) = _inputs()
    x, weights = x.requires_grad_(), weights.requires_grad_()
    with pytest.raises(ValueError, match=r"does not require grad though x does: the codec cut the autograd graph"):
        LocalDispatcher(E, _BitPattern()).dispatch(x, rm)
    with torch.no_grad():  # nothing recorded: the bit pattern is fine, and exact
        result = LocalDispatcher(E, _BitPattern()).dispatch(x, rm)
        torch.testing.assert_close(result.rows, x[rm.source_token], rtol=0, atol=0)
    # a lossy cast keeps the graph: x gets the experts' gradient
    dispatcher = LocalDispatcher(E, _Bf16())
    result = dispatcher.dispatch(x, rm)
    out = dispatcher.combine(swiglu_experts(result.rows, w1, w2, result.offsets), result, weights)
    gx, = torch.autograd.grad(out.sum(), x)
    assert gx.abs().sum() > 0


def test_all_to_all_dispatcher_refuses_a_codec_that_cuts_x_off_the_graph():
    """One gloo rank, in this process: the refusal travels through the status header as any bad input."""
    with kernels_spawn.one_gloo_rank() as group:
        rm, (x, *_) = _inputs()
        x.requires_grad_()
        with pytest.raises(ValueError, match=r"codec.encode\(rows\) does not require grad though x does"):
            AllToAllDispatcher(group, E, codec=_BitPattern()).dispatch(x, rm)
        result = AllToAllDispatcher(group, E, codec=_Bf16()).dispatch(x, rm)
        assert result.rows.requires_grad and result.rows.shape == (T * K, D)


def test_expert_ids_where_the_route_map_goes_and_non_tensors_are_named():
    rm, (x, weights, w1, w2) = _inputs()
    ids = torch.zeros(T, K, dtype=torch.int64)
    rows = permute(x, rm)
    not_a_map = r"route_map must be a RouteMap \(build_route_map\(expert_ids, num_experts\)\), got Tensor"
    for call in (
        lambda: permute(x, ids),
        lambda: combine(rows, ids, weights),
        lambda: moe_ffn(x, ids, weights, w1, w2),
        lambda: LocalDispatcher(E).dispatch(x, ids),
    ):
        with pytest.raises(TypeError, match=not_a_map):
            call()
    for call, match in (
        (lambda: permute(x.numpy(), rm), r"x must be a torch.Tensor \[T, d\], got ndarray"),
        (lambda: combine(rows, rm, weights.tolist()), r"router weights must be a torch.Tensor \[T=6, k=2\], got list"),
        (lambda: moe_ffn(x, rm, weights.numpy(), w1, w2), r"router weights must be a torch.Tensor .* got ndarray"),
        (lambda: grouped_gemm(rows, w1, rm.offsets.tolist()), r"offsets must be a torch.Tensor \[E=5\] .* got list"),
        (lambda: build_route_map(ids.tolist(), E), r"expert_ids must be a torch.Tensor \[T, k\], got list"),
    ):
        with pytest.raises(TypeError, match=match):
            call()
    with pytest.raises(ValueError, match=r"result.context is a NoneType: pass the DispatchResult"):
        LocalDispatcher(E).combine(rows, {"context": rm}, weights)
