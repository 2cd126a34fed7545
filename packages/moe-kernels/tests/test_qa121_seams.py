"""QA 121: the dispatch seams the next wave builds on, used as their docs describe (README, TokenDispatcher /
PayloadCodec / DispatchResult / RouteMap docstrings), nothing private.

- a loopback transport (all experts here, rows moved by its own index_select / index_add from the route map's
  documented sort_order) plugged into the README's block (dispatch -> swiglu_experts -> combine) equals
  LocalDispatcher's block, outputs and gradients, fp32 and bf16, odd T, empty experts, top-1, top-k = E, T = 0;
- a two-rank transport on plain torch.distributed (qa121_worker.PlainAllToAll) equals one process;
- codecs: encode sees the [T*k, d] rows in expert order and x's dtype, decode its payload; a lossy round trip and
  a straight-through per-row int8 quantiser (carried in a float payload) give x a gradient; wrong payloads and
  decoded rows of another width are refused with a ValueError naming them (the width was not checked before).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from moe_kernels import DispatchResult, LocalDispatcher, RouteMap, build_route_map, moe_ffn, swiglu_experts

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402
import qa121_worker  # noqa: E402
from fp8_codec import Fp8Codec  # noqa: E402

D, H = 6, 5


class Loopback:
    """A transport written from TokenDispatcher's docs: every expert here, through its own code path."""

    def __init__(self, num_experts: int, codec=None):
        self.num_experts = num_experts
        self.codec = codec

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        rows = x.index_select(0, route_map.sort_order // route_map.top_k)  # [T*k, d] expert order
        if self.codec is not None:
            rows = self.codec.decode(self.codec.encode(rows))
        return DispatchResult(rows, route_map.offsets, route_map, torch.zeros((), dtype=torch.int64))

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        rm = result.context
        w = weights.reshape(-1).index_select(0, rm.sort_order).float()
        out = torch.zeros(rm.num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        return out.index_add(0, rm.sort_order // rm.top_k, expert_out.float() * w[:, None]).to(expert_out.dtype)


def case(T: int, E: int, k: int, dtype: torch.dtype, empty: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([e for e in range(E) if e != empty])
    ids = (torch.stack([choices[torch.randperm(len(choices), generator=g)[:k]] for _ in range(T)])
           if T else torch.zeros(0, k, dtype=torch.int64))
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    weights = torch.rand(T, k, generator=g).requires_grad_()
    w1 = (torch.randn(E, D, 2 * H, generator=g) * D**-0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, H, D, generator=g) * H**-0.5).to(dtype).requires_grad_()
    return x, ids, weights, w1, w2


def block(dispatcher, x, ids, weights, w1, w2):
    """The README's block with a dispatcher: route map -> dispatch -> grouped SwiGLU experts -> combine."""
    result = dispatcher.dispatch(x, build_route_map(ids, w1.shape[0]))
    return dispatcher.combine(swiglu_experts(result.rows, w1, w2, result.offsets), result, weights)


def outputs_and_grads(dispatcher, x, ids, weights, w1, w2):
    y = block(dispatcher, x, ids, weights, w1, w2)
    grads = torch.autograd.grad(y.float().square().sum(), (x, weights, w1, w2), allow_unused=True)
    return [y] + [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (x, weights, w1, w2))]


def assert_close_all(got, want, dtype):
    tol = dict(rtol=0, atol=0) if dtype == torch.float64 else (
        dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2))
    for name, a, b in zip(("out", "x", "weights", "w_gate_up", "w_down"), got, want):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")


CASES = {  # T, E, k, empty expert
    "odd_T_top1": (13, 5, 1, None), "top_k_equals_E": (7, 4, 4, None), "empty_expert": (11, 6, 2, 2),
    "one_token": (1, 3, 2, None), "no_tokens": (0, 3, 2, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_loopback_transport_in_block_matches_local_dispatcher(name, dtype):
    T, E, k, empty = CASES[name]
    inputs = case(T, E, k, dtype, empty)
    want = outputs_and_grads(LocalDispatcher(E), *inputs)
    got = outputs_and_grads(Loopback(E), *inputs)
    assert got[0].dtype == want[0].dtype == dtype
    assert_close_all(got, want, dtype)
    # and LocalDispatcher's block is the fused moe_ffn the README names as its equal
    x, ids, weights, w1, w2 = inputs
    fused = moe_ffn(x, build_route_map(ids, E), weights, w1, w2)
    torch.testing.assert_close(fused, want[0], **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32
                                                  else dict(rtol=2e-2, atol=2e-2)))


def test_two_rank_plain_all_to_all_transport_matches_one_process(tmp_path):
    """A transport on plain torch.distributed (two gloo ranks, two experts each) against LocalDispatcher holding
    every rank's tokens: outputs, and the gradients of x, router weights and each rank's expert slice."""
    results = kernels_spawn.results_without_errors(
        str(Path(__file__).parent / "qa121_worker.py"), 2, tmp_path, 120)
    world = 2
    for name, (T, E, k, dtype, empty) in {
        "odd_T_top1": (7, 4, 1, torch.float32, None), "top_k_E": (5, 4, 4, torch.float32, None),
        "empty_expert": (9, 6, 2, torch.float32, 3), "T0": (0, 4, 2, torch.float32, None),
        "bf16": (7, 4, 2, torch.bfloat16, 1),
    }.items():
        x, ids, weights, w1, w2 = (t.requires_grad_() if t.is_floating_point() else t
                                   for t in qa121_worker.global_case(11, T, E, k, dtype, empty))
        y, gx, gw, g1, g2 = outputs_and_grads(LocalDispatcher(E), x, ids, weights, w1, w2)
        e_local = E // world
        got = [torch.cat([r["transport"][name][key] for r in results]) for key in ("y", "x", "w", "w1", "w2")]
        assert_close_all(got, [y, gx, gw, g1, g2], dtype)
        assert got[3].shape[0] == world * e_local
    for r in results:  # AllToAllDispatcher refuses decoded rows of another width than x (it ran them before)
        refused = r["narrowing"]["refused"]
        assert refused is not None and "(d=6, x's width), got (" in refused, r["narrowing"]
    for r in results:  # a payload that requires grad through a learnable scale only: refused on every rank
        refused = r["detached"]["refused"]
        assert refused is not None and "its autograd graph does not reach them" in refused, r["detached"]


class Spy:
    """A codec that records what it is handed: a bf16 round trip (lossy, autograd follows the casts)."""

    def __init__(self):
        self.seen = []

    def encode(self, rows):
        self.seen.append(("encode", tuple(rows.shape), rows.dtype, rows.requires_grad))
        return rows.to(torch.bfloat16)

    def decode(self, payload):
        self.seen.append(("decode", tuple(payload.shape), payload.dtype))
        return payload.to(torch.float32)


@pytest.mark.parametrize("dispatcher_kind", ["local", "loopback"])
def test_codec_sees_expert_ordered_rows_and_x_gets_the_round_trips_gradient(dispatcher_kind):
    T, E, k = 9, 4, 2
    x, ids, weights, w1, w2 = case(T, E, k, torch.float32)
    spy = Spy()
    dispatcher = LocalDispatcher(E, codec=spy) if dispatcher_kind == "local" else Loopback(E, codec=spy)
    rm = build_route_map(ids, E)
    result = dispatcher.dispatch(x, rm)
    assert spy.seen == [("encode", (T * k, D), torch.float32, True), ("decode", (T * k, D), torch.bfloat16)]
    # the rows are x's, in expert order, rounded once by the codec
    torch.testing.assert_close(result.rows, x.detach()[rm.sort_order // k].bfloat16().float(), rtol=0, atol=0)
    y = dispatcher.combine(swiglu_experts(result.rows, w1, w2, result.offsets), result, weights)
    gx, = torch.autograd.grad(y.square().sum(), x)
    # straight through: the bf16 casts' backward is a cast, so x's gradient is the one of the rounded rows
    rows = x.detach()[rm.sort_order // k].bfloat16().float().requires_grad_()
    y2 = combine_by_hand(swiglu_experts(rows, w1, w2, rm.offsets), rm, weights)
    grows, = torch.autograd.grad(y2.square().sum(), rows)
    want = torch.zeros_like(x).index_add(0, rm.sort_order // k, grows.bfloat16().float())
    torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-5)


def combine_by_hand(expert_out, rm, weights):
    w = weights.reshape(-1).index_select(0, rm.sort_order)
    return torch.zeros(rm.num_tokens, expert_out.shape[1]).index_add(0, rm.sort_order // rm.top_k,
                                                                      expert_out * w[:, None])


class _RoundInt8(torch.autograd.Function):
    """Straight-through per-row int8 rounding: the payload is float (autograd can carry it), its values int8."""

    @staticmethod
    def forward(ctx, rows):
        scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
        return torch.cat([(rows / scale).round().clamp(-127, 127), scale], 1)  # [N, d + 1]: values | scale

    @staticmethod
    def backward(ctx, grad):
        return grad[:, :-1]


class Int8RowCodec:
    def encode(self, rows):
        return _RoundInt8.apply(rows)

    def decode(self, payload):
        return payload[:, :-1] * payload[:, -1:]


def test_straight_through_int8_codec_gives_x_the_gradient_of_the_rows():
    T, E, k = 8, 4, 2
    x, ids, weights, w1, w2 = case(T, E, k, torch.float32)
    rm = build_route_map(ids, E)
    dispatcher = LocalDispatcher(E, codec=Int8RowCodec())
    result = dispatcher.dispatch(x, rm)
    rows = x.detach()[rm.sort_order // k]
    assert (result.rows - rows).abs().max() <= rows.abs().amax() / 127  # within one step of the row's scale
    y = dispatcher.combine(swiglu_experts(result.rows, w1, w2, result.offsets), result, weights)
    gx, = torch.autograd.grad(y.square().sum(), x)
    # by hand: the decoded rows' gradient times each row's scale, summed over the token's k slots
    r = result.rows.detach().requires_grad_()
    gr, = torch.autograd.grad(combine_by_hand(swiglu_experts(r, w1, w2, rm.offsets), rm, weights).square().sum(), r)
    scale = rows.abs().amax(1, keepdim=True) / 127
    torch.testing.assert_close(gx, torch.zeros_like(x).index_add(0, rm.sort_order // k, gr * scale),
                               rtol=1e-5, atol=1e-6)


_LEARNED_SCALE = torch.full((), 0.125, requires_grad=True)


class Codec:
    def __init__(self, encode, decode):
        self.encode, self.decode = encode, decode


BAD_CODECS = {
    "encode returns a tuple": (Codec(lambda r: (r, r.amax(1)), lambda p: p[0]), "codec.encode"),
    "encode drops a row": (Codec(lambda r: r[:-1], lambda p: p), "codec.encode"),
    "decode drops a row": (Codec(lambda r: r, lambda p: p[:-1]), "codec.decode"),
    "decode narrows the rows": (Codec(lambda r: r, lambda p: p[:, :-1]), "codec.decode"),
    "decode returns a list": (Codec(lambda r: r, lambda p: [p]), "codec.decode"),
    "an int8 bit pattern cuts the graph": (Codec(lambda r: (r * 8).round().to(torch.int8),
                                                 lambda p: p.float() / 8), "cut the autograd graph"),
    # decode's learnable scale requires grad, hiding the cut from a check of decode's output alone (moe-kernels
    # <= 0.9.11: x got no gradient, the scale all of it; AllToAllDispatcher refused it already)
    "an int8 bit pattern behind a learnable decode": (
        Codec(lambda r: (r * 8).round().to(torch.int8), lambda p: p.float() * _LEARNED_SCALE),
        r"codec\.encode\(rows\) does not require grad though x does"),
    # the rounding detached, a learnable scale after it: requires grad, through the scale alone (moe-kernels
    # <= 0.9.12 took it and x got no gradient; review helper 154)
    "a detached rounding times a learnable scale": (
        Codec(lambda r: (r / _LEARNED_SCALE).round().detach() * _LEARNED_SCALE, lambda p: p),
        r"codec\.encode\(rows\) requires grad, but not through the rows"),
    "decode detaches, then a learnable scale": (
        Codec(lambda r: r, lambda p: p.detach() * _LEARNED_SCALE),
        r"codec\.decode\(codec\.encode\(rows\)\) requires grad, but not through the rows"),
}


@pytest.mark.parametrize("name", list(BAD_CODECS))
def test_local_dispatcher_refuses_bad_codec_output_naming_it(name):
    codec, words = BAD_CODECS[name]
    x, ids, _, _, _ = case(5, 4, 2, torch.float32)
    with pytest.raises(ValueError, match=words):
        LocalDispatcher(4, codec=codec).dispatch(x, build_route_map(ids, 4))


def test_decoded_rows_of_another_width_are_refused_with_the_expected_d():
    x, ids, _, _, _ = case(5, 4, 2, torch.float32)
    codec, _ = BAD_CODECS["decode narrows the rows"]
    with pytest.raises(ValueError, match=r"\[T\*k=10, d\] rows the experts compute on \(d=6, x's width\), got \(10, 5\)"):
        LocalDispatcher(4, codec=codec).dispatch(x, build_route_map(ids, 4))


def test_a_float8_payload_carries_its_gradient_back_in_float8_as_the_docstring_says():
    """PayloadCodec's docstring: the payload's gradient comes back in the payload's dtype (autograd casts it)."""
    x, ids, weights, w1, w2 = case(6, 4, 1, torch.float32)
    rm = build_route_map(ids, 4)
    result = LocalDispatcher(4, codec=Fp8Codec()).dispatch(x, rm)
    g = torch.randn_like(result.rows) * 3
    gx, = torch.autograd.grad(result.rows, x, g)
    want = torch.zeros_like(x).index_add(0, rm.sort_order, g.to(torch.float8_e4m3fn).float())  # top-1: one slot
    torch.testing.assert_close(gx, want, rtol=0, atol=0)
    assert not torch.equal(gx, torch.zeros_like(x).index_add(0, rm.sort_order, g))


def test_token_dispatcher_is_checkable_with_isinstance():
    """A transport author can ask whether an object implements the protocol (isinstance raised TypeError: the
    Protocol was not runtime-checkable). It checks the members' presence only, as Python's protocols do."""
    from moe_kernels import LocalDispatcher, TokenDispatcher

    assert isinstance(LocalDispatcher(4), TokenDispatcher)
    assert not isinstance(object(), TokenDispatcher)
