"""QA 75: the dispatch seams the next wave plugs into, used from outside the package through public API only.

A transport written here (`ScatterDispatcher`: every expert local, rows moved by its own index scatter, not by
permute / combine) satisfies TokenDispatcher and gives the fused moe_ffn's outputs and gradients. PayloadCodecs
written here (a lossy bf16 round trip; a fake MX block format whose payload is [N, d/B, B+1]: B values and one
packed scale per block) run through LocalDispatcher and, on 2 gloo ranks (one spawn), AllToAllDispatcher: encode
and decode are called once per dispatch, the rows equal the codec applied by hand, gradients match the same
codec applied by hand, and bad codecs are refused with a ValueError naming what is wrong.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_kernels import (
    AllToAllDispatcher,
    DispatchResult,
    LocalDispatcher,
    RouteMap,
    TokenDispatcher,
    build_route_map,
    combine,
    moe_ffn,
    permute,
    swiglu_experts,
)

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402

WORLD = 2
COLLECTIVE_TIMEOUT_S = 30
DEADLINE_S = 120
D, H, BLOCK = 8, 6, 4


# ---- a third party's transport and codecs ------------------------------------------------------------------

@dataclass
class ScatterContext:
    route_map: RouteMap


class ScatterDispatcher:
    """Every expert local; dispatch scatters each (token, slot) row to its expert-sorted row with index_copy,
    combine gathers them back by dest_row and sums with the router weights."""

    def __init__(self, num_experts: int):
        self.num_local_experts = num_experts

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        flat = x.repeat_interleave(route_map.top_k, dim=0)  # flat row t*k + s is x[t]
        rows = x.new_zeros((route_map.num_rows, x.shape[1])).index_copy(0, route_map.dest_row, flat)
        return DispatchResult(rows, route_map.offsets, ScatterContext(route_map), torch.zeros((), dtype=torch.int64))

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        rm = result.context.route_map
        back = expert_out.index_select(0, rm.dest_row).view(rm.num_tokens, rm.top_k, expert_out.shape[1])
        return (back * weights.to(back.dtype).unsqueeze(-1)).sum(1)


class CountingCodec:
    def __init__(self):
        self.encoded = self.decoded = 0

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        self.encoded += 1
        return self.pack(rows)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        self.decoded += 1
        return self.unpack(payload)


class Bf16Codec(CountingCodec):
    """fp32 rows travel as bf16 (lossy), come back as fp32."""

    def pack(self, rows):  # noqa: ANN001, ANN201
        return rows.to(torch.bfloat16)

    def unpack(self, payload):  # noqa: ANN001, ANN201
        return payload.to(torch.float32)


class BlockScaledCodec(CountingCodec):
    """A fake MX format: each block of BLOCK values is divided by its absmax, rounded to bf16, and travels with that
    scale packed beside it as one more column: payload [N, d/BLOCK, BLOCK + 1] fp32."""

    def pack(self, rows):  # noqa: ANN001, ANN201
        blocks = rows.reshape(rows.shape[0], rows.shape[1] // BLOCK, BLOCK)
        scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        return torch.cat([(blocks / scale).to(torch.bfloat16).to(rows.dtype), scale], -1)

    def unpack(self, payload):  # noqa: ANN001, ANN201
        return (payload[..., :BLOCK] * payload[..., BLOCK:]).reshape(payload.shape[0], payload.shape[1] * BLOCK)


class TupleEncode(Bf16Codec):
    def pack(self, rows):  # noqa: ANN001, ANN201
        return rows, rows.abs().amax(1)


class DroppedRowEncode(Bf16Codec):
    def pack(self, rows):  # noqa: ANN001, ANN201
        return rows[1:]


class BitPatternEncode(Bf16Codec):
    """uint8 bit pattern with no autograd Function: cuts the graph in encode."""

    def pack(self, rows):  # noqa: ANN001, ANN201
        return rows.detach().view(torch.uint8)

    def unpack(self, payload):  # noqa: ANN001, ANN201
        return payload.view(torch.float32)


class TupleDecode(Bf16Codec):
    def unpack(self, payload):  # noqa: ANN001, ANN201
        return payload.to(torch.float32), None


class ThreeDimDecode(BlockScaledCodec):
    """Forgets to flatten the blocks: [N, d/BLOCK, BLOCK]."""

    def unpack(self, payload):  # noqa: ANN001, ANN201
        return payload[..., :BLOCK] * payload[..., BLOCK:]


class DetachingDecode(Bf16Codec):
    """The payload travels fine, but decode cuts the graph: x would silently get no gradient from the experts."""

    def unpack(self, payload):  # noqa: ANN001, ANN201
        return payload.detach().to(torch.float32)


BAD_CODECS = {  # name -> (codec class, what the ValueError must say)
    "tuple_encode": (TupleEncode, "codec.encode must return a tensor"),
    "dropped_row_encode": (DroppedRowEncode, "codec.encode must return a tensor"),
    "bit_pattern_encode": (BitPatternEncode, "cut the autograd graph"),
    "tuple_decode": (TupleDecode, "codec.decode must return"),
    "three_dim_decode": (ThreeDimDecode, "codec.decode must return"),
    "detaching_decode": (DetachingDecode, "cut the autograd graph"),
}


# ---- helpers -------------------------------------------------------------------------------------------------

def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int, empty: tuple[int, ...] = ()):
    """x [T, D], expert ids [T, k] (experts in `empty` get no rows), router weights [T, k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, D, generator=g)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if empty:
        logits[:, list(empty)] = -float("inf")
    ids = logits.topk(top_k, -1).indices
    weights = torch.rand(num_tokens, top_k, generator=g)
    return x, ids, weights


def _experts(num_experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, D, 2 * H, generator=g) * 0.3, torch.randn(num_experts, H, D, generator=g) * 0.3


def _leaves(*tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def _grads(out: torch.Tensor, leaves, seed: int):
    g = torch.Generator().manual_seed(seed)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return [t.grad for t in leaves]


def _through(dispatcher: TokenDispatcher, x, rm, weights, w1, w2):
    result = dispatcher.dispatch(x, rm)
    return dispatcher.combine(swiglu_experts(result.rows, w1, w2, result.offsets, "reference"), result, weights)


def _by_hand(codec_cls, x, rm, weights, w1, w2):
    """The codec applied by hand around the stock permute / combine (no dispatcher)."""
    codec = codec_cls()
    rows = codec.unpack(codec.pack(permute(x, rm)))
    return combine(swiglu_experts(rows, w1, w2, rm.offsets, "reference"), rm, weights)


# ---- one process ---------------------------------------------------------------------------------------------

CASES = [  # (T, E, k, empty experts)
    (7, 4, 2, (1,)),
    (1, 3, 3, ()),
    (13, 6, 2, (0, 5)),
    (0, 4, 2, ()),
    (9, 5, 1, (2, 3)),
]


@pytest.mark.parametrize("tokens,experts,top_k,empty", CASES)
def test_a_transport_written_outside_matches_the_fused_block_outputs_and_every_gradient(tokens, experts, top_k, empty):
    x, ids, weights = _routing(tokens, experts, top_k, seed=tokens * 31 + experts, empty=empty)
    w1, w2 = _experts(experts, seed=experts)
    rm = build_route_map(ids, experts)
    assert all(int(rm.counts[e]) == 0 for e in empty)
    mine = _leaves(x, weights, w1, w2)
    stock = _leaves(x, weights, w1, w2)
    dispatcher = ScatterDispatcher(experts)
    out = _through(dispatcher, mine[0], rm, *mine[1:])
    ref = moe_ffn(stock[0], rm, *stock[1:], backend="reference")
    torch.testing.assert_close(out, ref)
    for name, got, want in zip(("x", "weights", "w_gate_up", "w_down"), _grads(out, mine, 1), _grads(ref, stock, 1)):
        torch.testing.assert_close(got, want, msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize("codec_cls", [Bf16Codec, BlockScaledCodec])
@pytest.mark.parametrize("tokens,experts,top_k,empty", CASES[:4])
def test_a_codec_through_local_dispatch_is_called_once_each_way_and_equals_the_codec_applied_by_hand(
        codec_cls, tokens, experts, top_k, empty):
    x, ids, weights = _routing(tokens, experts, top_k, seed=tokens + 7, empty=empty)
    w1, w2 = _experts(experts, seed=experts + 1)
    rm = build_route_map(ids, experts)
    codec = codec_cls()
    dispatcher = LocalDispatcher(experts, codec=codec)
    mine, hand = _leaves(x, weights, w1, w2), _leaves(x, weights, w1, w2)
    result = dispatcher.dispatch(mine[0], rm)
    assert (codec.encoded, codec.decoded) == (1, 1)
    rows_by_hand = codec_cls().unpack(codec_cls().pack(permute(x, rm)))
    assert torch.equal(result.rows, rows_by_hand)
    if tokens:
        assert not torch.equal(result.rows, permute(x, rm)), "the codec was meant to be lossy"
    out = dispatcher.combine(swiglu_experts(result.rows, *mine[2:], result.offsets, "reference"), result, mine[1])
    ref = _by_hand(codec_cls, hand[0], rm, *hand[1:])
    assert torch.equal(out, ref)
    for got, want in zip(_grads(out, mine, 2), _grads(ref, hand, 2)):
        assert got is not None and torch.equal(got, want)


def test_the_block_scaled_payload_has_its_own_trailing_shape():
    x, ids, _ = _routing(5, 4, 2, seed=3)
    payload = BlockScaledCodec().encode(permute(x, build_route_map(ids, 4)))
    assert payload.shape == (10, D // BLOCK, BLOCK + 1)


@pytest.mark.parametrize("name", sorted(BAD_CODECS))
def test_a_bad_codec_is_refused_by_local_dispatch_with_what_is_wrong(name):
    codec_cls, says = BAD_CODECS[name]
    x, ids, _ = _routing(5, 4, 2, seed=11)
    dispatcher = LocalDispatcher(4, codec=codec_cls())
    with pytest.raises(ValueError, match=says):
        dispatcher.dispatch(x.requires_grad_(True), build_route_map(ids, 4))


# ---- 2 gloo ranks (one spawn) ----------------------------------------------------------------------------------

EP_E, EP_K = 4, 2
EP_TOKENS = (7, 3)  # per rank: odd, and different
EP_EMPTY = (2,)  # expert 2 (rank 1's first local expert) gets no rows from anyone


def _ep_inputs(rank: int, empty: tuple[int, ...] = EP_EMPTY):
    return _routing(EP_TOKENS[rank], EP_E, EP_K, seed=100 + rank, empty=empty)


def _ep_codec_case(rank: int, codec_cls, empty: tuple[int, ...] = EP_EMPTY) -> dict:
    """This rank's dispatch and combine through AllToAllDispatcher with the codec, and the same codec applied by hand
    in one process to every rank's tokens (each rank rebuilds every rank's inputs from the seeds)."""
    e_local = EP_E // WORLD
    w1, w2 = _experts(EP_E, seed=5)
    lo, hi = rank * e_local, (rank + 1) * e_local
    x, ids, weights = _ep_inputs(rank, empty)
    codec = codec_cls()
    dispatcher = AllToAllDispatcher(dist.group.WORLD, EP_E, codec=codec)
    mine = _leaves(x, weights, w1[lo:hi], w2[lo:hi])
    result = dispatcher.dispatch(mine[0], build_route_map(ids, EP_E))
    calls = (codec.encoded, codec.decoded)
    out = dispatcher.combine(swiglu_experts(result.rows, *mine[2:], result.offsets, "reference"), result, mine[1])
    grads = _grads(out, mine, 10 + rank)

    every = [_ep_inputs(r, empty) for r in range(WORLD)]
    xs, idss, ws = (torch.cat(parts) for parts in zip(*every))
    rm = build_route_map(idss, EP_E)
    rows_by_hand = codec_cls().unpack(codec_cls().pack(permute(xs, rm)))
    start = 0 if lo == 0 else int(rm.offsets[lo - 1])
    hand = _leaves(xs, ws, w1, w2)
    ref = _by_hand(codec_cls, hand[0], rm, *hand[1:])
    g = torch.cat([torch.randn((EP_TOKENS[r], D), generator=torch.Generator().manual_seed(10 + r))
                   for r in range(WORLD)])  # the cotangents each rank drew in _grads
    (ref * g).sum().backward()
    first = sum(EP_TOKENS[:rank])
    rows = slice(first, first + EP_TOKENS[rank])
    return {
        "calls": calls,
        "rows_equal": torch.equal(result.rows, rows_by_hand[start:int(rm.offsets[hi - 1])]),
        "num_rows": result.rows.shape[0],
        "out_err": (out - ref[rows]).abs().max().item() if out.numel() else 0.0,
        "grad_errs": [(got - want).abs().max().item() if got.numel() else 0.0 for got, want in
                      zip(grads, (hand[0].grad[rows], hand[1].grad[rows], hand[2].grad[lo:hi], hand[3].grad[lo:hi]))],
    }


def _ep_bad_codec_case(rank: int, codec_cls) -> str:
    x, ids, _ = _ep_inputs(rank)
    dispatcher = AllToAllDispatcher(dist.group.WORLD, EP_E, codec=codec_cls())
    try:
        dispatcher.dispatch(x.requires_grad_(True), build_route_map(ids, EP_E))
    except Exception as e:  # noqa: BLE001 - the parent checks which
        return f"{type(e).__name__}: {e}"
    return "no error"


def _cases(rank: int) -> dict:
    torch.set_num_threads(1)
    res = {"codec": {c.__name__: _ep_codec_case(rank, c) for c in (Bf16Codec, BlockScaledCodec)}, "bad": {}}
    res["codec"]["rank 1 receives no row"] = _ep_codec_case(rank, BlockScaledCodec, empty=(2, 3))
    for name, (codec_cls, _) in sorted(BAD_CODECS.items()):
        res["bad"][name] = _ep_bad_codec_case(rank, codec_cls)
        dist.barrier()
    return res


def _entry(rank: int, port: int, out_dir: str) -> None:
    kernels_spawn.run_gloo_rank(rank, port, out_dir, WORLD, COLLECTIVE_TIMEOUT_S, _cases)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return kernels_spawn.results_without_errors(__file__, WORLD, tmp_path_factory.mktemp("qa75"), DEADLINE_S)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["Bf16Codec", "BlockScaledCodec", "rank 1 receives no row"])
def test_a_codec_through_all_to_all_is_called_once_each_way_and_matches_the_codec_applied_by_hand(ranks, codec):
    for rank, res in enumerate(ranks):
        case = res["codec"][codec]
        assert case["calls"] == (1, 1), (rank, case)
        assert case["rows_equal"], (rank, case)
        assert case["out_err"] < 1e-5, (rank, case)
        assert max(case["grad_errs"]) < 1e-5, (rank, case)
    # expert 2 is empty; rank 1's expert 3 gets rows from both ranks, unless it is empty too
    assert (ranks[1]["codec"][codec]["num_rows"] == 0) == (codec == "rank 1 receives no row")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD_CODECS))
def test_a_bad_codec_is_refused_by_all_to_all_on_every_rank_with_what_is_wrong(ranks, name):
    _, says = BAD_CODECS[name]
    for rank, res in enumerate(ranks):
        message = res["bad"][name]
        assert message.startswith("ValueError") and says in message, f"rank {rank}: {message}"


def test_dispatch_rows_of_the_scatter_transport_are_the_stock_permute():
    x, ids, _ = _routing(11, 5, 2, seed=4, empty=(4,))
    rm = build_route_map(ids, 5)
    assert torch.equal(ScatterDispatcher(5).dispatch(x, rm).rows, permute(x, rm))
