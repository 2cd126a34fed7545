"""AllToAllDispatcher.combine and dispatch on 3 gloo ranks: bad input on ONE rank makes EVERY rank raise, before
any row moves, the other ranks quoting the error of the rank at fault.

Before, combine checked its inputs on each rank alone: the rank at fault raised while its peers entered the
row exchange and waited there, until the process-group timeout or until the rank at fault's next collective
met them there and gloo aborted every process on the mismatched sizes (SIGABRT); rows of another width or
dtype, or a DispatchResult of another dispatcher or dispatch call, went into the exchange on mismatched
sizes; router weights of the wrong shape raised on that rank only after the exchange, the peers went on.
Dispatch already refused on every rank, but its peers only said that rank "refused its inputs", without
its error (group `dispatch_refusal`).
Each case damages rank 1's inputs only; every rank records how its combine ended. After the refused calls a
good combine must go through and match one process running the whole batch through LocalDispatcher
(outputs and gradients), so no half-done exchange is left behind.

One spawn runs every case group in order (~15-25 s on 2 CPU cores); the process group has a 60 s timeout
and the spawn a deadline, so a rank that does not raise fails the test instead of hanging it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_kernels import AllToAllDispatcher, LocalDispatcher, RouteMap, build_route_map, swiglu_experts

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402

pytestmark = pytest.mark.slow
WORLD, BAD = 3, 1  # rank BAD's inputs are damaged, the others' are good
SIZES = (7, 5, 6)  # tokens per rank
E, K, D, H = 6, 2, 8, 4  # 2 experts per rank
COLLECTIVE_TIMEOUT_S = 60  # a collective one rank never joins fails after this, not after 30 minutes
DEADLINE_S = 180


# ---- one global batch, and the one-process reference ---------------------------------------------------
def _batch(seed: int, sizes: tuple[int, ...] = SIZES) -> tuple[torch.Tensor, ...]:
    """x, ids, weights, w1, w2, probe of the global batch: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    t = sum(sizes)
    return (torch.randn(t, D, generator=g), torch.randn(t, E, generator=g).topk(K, -1).indices,
            torch.rand(t, K, generator=g), torch.randn(E, D, 2 * H, generator=g) * D**-0.5,
            torch.randn(E, H, D, generator=g) * H**-0.5, torch.randn(t, D, generator=g))


def _tokens(rank: int, sizes: tuple[int, ...] = SIZES) -> slice:
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def _experts(rank: int) -> slice:
    return slice(rank * E // WORLD, (rank + 1) * E // WORLD)


def _mine(rank: int, batch: tuple[torch.Tensor, ...], sizes: tuple[int, ...] = SIZES) -> tuple[torch.Tensor, ...]:
    """This rank's tokens and experts of the global batch."""
    x, ids, weights, w1, w2, probe = batch
    tok, exp = _tokens(rank, sizes), _experts(rank)
    return x[tok], ids[tok], weights[tok], w1[exp], w2[exp], probe[tok]


def _dispatch(dispatcher, x, ids, weights, w1, w2):  # noqa: ANN001, ANN202
    """Leaves (x, weights, w1, w2), the DispatchResult and the expert rows, up to combine."""
    leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    result = dispatcher.dispatch(leaves[0], build_route_map(ids, E))
    return leaves, result, swiglu_experts(result.rows, leaves[2], leaves[3], result.offsets, "reference")


def _fwd_bwd(dispatcher, x, ids, weights, w1, w2, probe) -> list[torch.Tensor]:  # noqa: ANN001
    leaves, result, expert_out = _dispatch(dispatcher, x, ids, weights, w1, w2)
    out = dispatcher.combine(expert_out, result, leaves[1])
    (out * probe).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _good(rank: int, dispatcher: AllToAllDispatcher, seed: int) -> dict | tuple:
    """A good combine on every rank: relative error per output / gradient against the one-process reference."""

    def run() -> dict:
        batch = _batch(seed)
        out, x_grad, weights_grad, w1_grad, w2_grad = _fwd_bwd(LocalDispatcher(E), *batch)
        tok, exp = _tokens(rank), _experts(rank)
        want = {"out": out[tok], "x_grad": x_grad[tok], "weights_grad": weights_grad[tok],
                "w1_grad": w1_grad[exp], "w2_grad": w2_grad[exp]}
        got = _fwd_bwd(dispatcher, *_mine(rank, batch))
        return {n: ((a - b).abs().max() / b.abs().max()).item() for (n, b), a in zip(want.items(), got)}

    return _outcome(run)


def _outcome(fn):  # noqa: ANN001, ANN202
    """fn() if it returns, else (exception type, its text, its notes): every kind of failure is recorded."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported to the parent (a gloo timeout is a RuntimeError)
        return (type(e).__name__, str(e), " ".join(getattr(e, "__notes__", [])))


def _attempt(rank: int, dispatcher: AllToAllDispatcher, seed: int, damage) -> str | tuple:  # noqa: ANN001
    """Dispatch on every rank, then combine with rank BAD's (expert_out, result, weights) passed through damage."""
    x, ids, weights, w1, w2, _ = _mine(rank, _batch(seed))
    leaves, result, expert_out = _dispatch(dispatcher, x, ids, weights, w1, w2)
    args = (expert_out, result, leaves[1])
    if rank == BAD:
        args = damage(*args)

    def combine() -> str:
        dispatcher.combine(*args)
        return "ok"

    return _outcome(combine)


# ---- case groups: each runs on every rank, in order, in one spawn --------------------------------------
def good_before(rank: int) -> dict:
    return {"good": _good(rank, AllToAllDispatcher(dist.group.WORLD, E), seed=0)}


def expert_out_shape(rank: int) -> dict:
    disp = AllToAllDispatcher(dist.group.WORLD, E)
    return {
        "one_row_short": _attempt(rank, disp, 1, lambda out, res, w: (out[:-1], res, w)),
        "three_d": _attempt(rank, disp, 2, lambda out, res, w: (out[:, None], res, w)),
        "wider": _attempt(rank, disp, 3, lambda out, res, w: (torch.cat([out, out[:, :2]], 1), res, w)),
        "then_good": _good(rank, disp, seed=4),
    }


def expert_out_dtype(rank: int) -> dict:
    disp = AllToAllDispatcher(dist.group.WORLD, E)
    return {
        "bf16": _attempt(rank, disp, 5, lambda out, res, w: (out.to(torch.bfloat16), res, w)),
        "int64": _attempt(rank, disp, 6, lambda out, res, w: (out.to(torch.int64), res, w)),
        "then_good": _good(rank, disp, seed=7),
    }


def another_result(rank: int) -> dict:
    disp, other = AllToAllDispatcher(dist.group.WORLD, E), AllToAllDispatcher(dist.group.WORLD, WORLD)
    cases = {}
    # another dispatcher's result (one expert per rank), with expert rows of its row count
    x, ids = _mine(rank, _batch(8))[:2]
    foreign = other.dispatch(x, build_route_map(ids % WORLD, WORLD))
    cases["another_dispatcher"] = _attempt(rank, disp, 9, lambda out, res, w: (foreign.rows * 2, foreign, w))
    # the whole of an earlier dispatch call of this dispatcher (same shapes): nothing on rank 1 alone is wrong
    early_leaves, early, early_out = _dispatch(disp, *_mine(rank, _batch(10))[:5])
    cases["an_earlier_dispatch"] = _attempt(rank, disp, 11, lambda out, res, w: (early_out, early, early_leaves[1]))
    # the result of an earlier call of another shape, with this call's rows and weights
    sizes = (4, 9, 3)
    _, early, _ = _dispatch(disp, *_mine(rank, _batch(12, sizes), sizes)[:5])
    cases["an_earlier_result_of_another_shape"] = _attempt(rank, disp, 13, lambda out, res, w: (out, early, w))
    cases["then_good"] = _good(rank, disp, seed=14)
    return cases


def router_weights(rank: int) -> dict:
    disp = AllToAllDispatcher(dist.group.WORLD, E)

    def nan_weight() -> dict:
        """NaN weights are values, not an input error: the call goes through, NaN only in that token's row."""
        x, ids, weights, w1, w2, _ = _mine(rank, _batch(17))
        nan = weights.clone()
        if rank == BAD:
            nan[2, 0] = float("nan")
        outs = []
        for w in (nan, weights):  # every rank: the call with rank BAD's NaN, then the same call without it
            leaves, result, expert_out = _dispatch(disp, x, ids, w, w1, w2)
            outs.append(disp.combine(expert_out, result, leaves[1]).detach())
        finite = ~outs[0].isnan().any(1)
        return {"nan_rows": (~finite).nonzero().flatten().tolist(),
                "same_elsewhere": torch.equal(outs[0][finite], outs[1][finite])}

    return {
        "transposed": _attempt(rank, disp, 15, lambda out, res, w: (out, res, w.t())),
        "integer": _attempt(rank, disp, 16, lambda out, res, w: (out, res, (w * 10).long())),
        "nan": _outcome(nan_weight),
        "then_good": _good(rank, disp, seed=18),
    }


def _dispatch_attempt(rank: int, dispatcher: AllToAllDispatcher, seed: int, damage,  # noqa: ANN001
                      bad: tuple[int, ...] = (BAD,)) -> str | tuple:
    """Dispatch on every rank; on the ranks in `bad`, x and the route map come from damage(x, ids)."""
    x, ids = _mine(rank, _batch(seed))[:2]
    x, route_map = damage(x, ids) if rank in bad else (x, build_route_map(ids, E))

    def dispatch() -> str:
        dispatcher.dispatch(x, route_map)
        return "ok"

    return _outcome(dispatch)


def _one_count_more(ids: torch.Tensor) -> RouteMap:
    """A hand-built route map whose counts do not sum to T*k."""
    rm = build_route_map(ids, E)
    counts = rm.counts.clone()
    counts[0] += 1
    return dataclasses.replace(rm, counts=counts)


def dispatch_refusal(rank: int) -> dict:
    disp = AllToAllDispatcher(dist.group.WORLD, E)
    return {
        "x_three_d": _dispatch_attempt(rank, disp, 20, lambda x, ids: (x[:, None], build_route_map(ids, E))),
        "x_one_row_more": _dispatch_attempt(rank, disp, 21, lambda x, ids: (torch.cat([x, x[:1]]),
                                                                           build_route_map(ids, E))),
        "x_on_another_device": _dispatch_attempt(rank, disp, 22, lambda x, ids: (x.to("meta"),
                                                                                build_route_map(ids, E))),
        "route_map_over_another_E": _dispatch_attempt(rank, disp, 23, lambda x, ids: (x, build_route_map(ids, 2 * E))),
        "counts_not_summing_to_rows": _dispatch_attempt(rank, disp, 24, lambda x, ids: (x, _one_count_more(ids))),
        # rows of another width or dtype are no error of one rank: every rank raises the same disagreement
        "wider": _dispatch_attempt(rank, disp, 25, lambda x, ids: (torch.cat([x, x[:, :2]], 1),
                                                                  build_route_map(ids, E))),
        "int64": _dispatch_attempt(rank, disp, 26, lambda x, ids: (x.long(), build_route_map(ids, E))),
        # rank 0's route map is over another E, rank 1's x is 3-D; rank 2 is good
        "two_bad_ranks": _dispatch_attempt(
            rank, disp, 27,
            lambda x, ids: (x, build_route_map(ids, 2 * E)) if rank == 0 else (x[:, None], build_route_map(ids, E)),
            bad=(0, BAD),
        ),
        "then_good": _good(rank, disp, seed=28),
    }


GROUPS = ("good_before", "expert_out_shape", "expert_out_dtype", "another_result", "router_weights",
          "dispatch_refusal")


# ---- spawning ------------------------------------------------------------------------------------------
def _entry(groups: tuple[str, ...], rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    path = os.path.join(out_dir, f"rank{rank}.pt")
    res: dict = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        for name in groups:
            res[name] = globals()[name](rank)
            torch.save(res, path)  # kept as it goes: a rank that dies in a later group still reports this one
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        res["error"] = traceback.format_exc()
    torch.save(res, path)


def _spawn(groups: tuple[str, ...], out_dir: Path) -> list[dict]:
    """Each rank's {group: cases}; a rank that hung or died has an "ended" entry saying so."""
    results = []
    for res, code, hung in kernels_spawn.spawn(__file__, WORLD, out_dir, DEADLINE_S, groups):
        if hung:
            res["ended"] = f"still running after {DEADLINE_S} s (in a collective a peer never joined?)"
        elif code != 0:
            res["ended"] = f"exit code {code} (a gloo abort on mismatched rows?)"
        results.append(res)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return _spawn(GROUPS, tmp_path_factory.mktemp("combine_refusal"))


def _cases(ranks: list[dict], group: str) -> list[dict]:
    """Every rank's cases of `group`; fails naming how a rank ended when it has none."""
    for r, res in enumerate(ranks):
        assert group in res, f"rank {r} has no result for {group}: {res.get('ended', '')}\n{res.get('error', '')}"
    return [res[group] for res in ranks]


def _all_refused(cases: list[dict], case: str, *parts: str) -> None:
    """Every rank raised a ValueError containing every part."""
    for r, got in enumerate(c[case] for c in cases):
        assert isinstance(got, tuple) and got[0] == "ValueError", f"rank {r} {case}: {got}"
        for part in parts:
            assert part in got[1], f"rank {r} {case}: {part!r} not in {got[1]!r}"


def _refused_on_bad_rank(cases: list[dict], case: str, kind: str, *parts: str) -> None:
    """Rank BAD raised `kind` with every part; every other rank a ValueError naming rank BAD and quoting it."""
    own = cases[BAD][case]
    assert isinstance(own, tuple) and own[0] == kind, f"rank {BAD} {case}: {own}"
    for part in parts:
        assert part in own[1], f"rank {BAD} {case}: {part!r} not in {own[1]!r}"
    assert f"EP rank {BAD} of {WORLD}" in own[2], f"rank {BAD} {case}: notes {own[2]!r}"
    for r, got in enumerate(c[case] for c in cases):
        if r != BAD:
            assert isinstance(got, tuple) and got[0] == "ValueError", f"rank {r} {case}: {got}"
            assert f"EP rank {BAD}: {own[0]}: {own[1]}" in got[1], f"rank {r} {case}: {got[1]!r}"


def test_expert_out_of_another_shape_on_one_rank_raises_on_every_rank(ranks):
    cases = _cases(ranks, "expert_out_shape")
    _refused_on_bad_rank(cases, "one_row_short", "ValueError", "rows, dispatch handed out N_kept=")
    _refused_on_bad_rank(cases, "three_d", "ValueError", "expert_out must be 2-D [N_kept, d], got shape")
    _all_refused(cases, "wider", "EP rank 1: d=10 torch.float32", "the other EP ranks: d=8 torch.float32")


def test_expert_out_of_another_dtype_on_one_rank_raises_on_every_rank(ranks):
    cases = _cases(ranks, "expert_out_dtype")
    _all_refused(cases, "bf16", "EP rank 1: d=8 torch.bfloat16", "the other EP ranks: d=8 torch.float32")
    _refused_on_bad_rank(cases, "int64", "ValueError", "expert_out must be floating point", "torch.int64")


def test_a_dispatch_result_of_another_dispatcher_or_call_on_one_rank_raises_on_every_rank(ranks):
    cases = _cases(ranks, "another_result")
    _refused_on_bad_rank(cases, "another_dispatcher", "ValueError", "another AllToAllDispatcher")
    _all_refused(cases, "an_earlier_dispatch", "EP rank 1: dispatch #", "the other EP ranks: dispatch #")
    _refused_on_bad_rank(cases, "an_earlier_result_of_another_shape", "ValueError")


def test_router_weights_of_another_shape_or_dtype_on_one_rank_raise_on_every_rank_nan_values_do_not(ranks):
    cases = _cases(ranks, "router_weights")
    _refused_on_bad_rank(cases, "transposed", "ValueError", "weights shape (2, 5) != (T, k)=(5, 2)")
    _refused_on_bad_rank(cases, "integer", "ValueError", "must be a floating-point tensor", "torch.int64")
    for r, got in enumerate(c["nan"] for c in cases):
        assert got == {"nan_rows": [2] if r == BAD else [], "same_elsewhere": True}, f"rank {r}: {got}"


def test_bad_x_or_route_map_on_one_rank_makes_the_other_ranks_dispatch_raise_quoting_its_error(ranks):
    cases = _cases(ranks, "dispatch_refusal")
    _refused_on_bad_rank(cases, "x_three_d", "ValueError", "x must be 2-D [T, d], got shape (5, 1, 8)")
    _refused_on_bad_rank(cases, "x_one_row_more", "ValueError", "x has 6 rows but the route map was built for 5 tokens")
    _refused_on_bad_rank(cases, "x_on_another_device", "ValueError", "x is on device=meta")
    _refused_on_bad_rank(cases, "route_map_over_another_E", "ValueError",
                         "route map has 12 experts, dispatcher expects 6")
    _refused_on_bad_rank(cases, "counts_not_summing_to_rows", "ValueError", "do not sum to T*k=10 rows")


def test_rows_of_another_width_or_dtype_on_one_rank_make_every_rank_dispatch_raise_the_same_error(ranks):
    cases = _cases(ranks, "dispatch_refusal")
    _all_refused(cases, "wider", "rank 1: d=10 (10 values per row, torch.float32)", "rank 0: d=8")
    _all_refused(cases, "int64", "rank 1: d=8 (8 values per row, torch.int64)",
                 "rank 0: d=8 (8 values per row, torch.float32)")
    for case in ("wider", "int64"):
        assert len({c[case] for c in cases}) == 1, f"{case}: {[c[case] for c in cases]}"


def test_bad_input_on_two_ranks_makes_dispatch_quote_both_errors(ranks):
    got = [c["two_bad_ranks"] for c in _cases(ranks, "dispatch_refusal")]
    for r, kind in enumerate(g[0] if isinstance(g, tuple) else g for g in got):
        assert kind == "ValueError", f"rank {r}: {got[r]}"
    e_text, x_text = (f"ValueError: {got[r][1]}" for r in (0, 1))
    assert "route map has 12 experts" in e_text and "x must be 2-D" in x_text, got
    assert f"EP rank 0: {e_text}" in got[2][1] and f"EP rank 1: {x_text}" in got[2][1], got[2]
    assert f"also EP rank 1: {x_text}" in got[0][2] and f"also EP rank 0: {e_text}" in got[1][2], got


def test_good_combines_before_and_after_refused_ones_match_the_one_process_reference(ranks):
    checked = [("good_before", "good")] + [(g, "then_good") for g in GROUPS[1:]]
    for group, case in checked:
        for r, got in enumerate(c[case] for c in _cases(ranks, group)):
            assert isinstance(got, dict), f"rank {r} {group}.{case}: {got}"
            for what, err in got.items():
                assert err <= 1e-5, f"rank {r} {group}.{case} {what}: relative error {err:.3g}"
