"""Independent QA (3 gloo ranks, one spawn, ~15 s on 2 cores): AllToAllDispatcher on an odd number of EP ranks
against one process holding every token and every expert. Uneven token counts with a rank holding none; two MoE
layers sharing one dispatcher under one backward, plain and inside torch.utils.checkpoint (non-reentrant with
its default early stop, and reentrant: the recomputation re-issues the collectives and must pair on every rank);
bf16 rows; a capacity with top_k = E where a rank with no tokens keeps as many of the rows it receives as the others
(the module docstring's ceil(c * R) per rank, R the EP group's mean T * k; before moe-kernels 0.10.0 R was the rank's
own T * k, and a rank with no tokens dropped every row it received). Outputs and the gradients of x, the
router weights and the expert weights are compared; dropped rows get zero gradient and are counted.
capacity_factor that is no number (True, None) is refused naming it (True was taken as a capacity of 1.0)."""

from __future__ import annotations

import math
from fractions import Fraction
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint

from moe_kernels import AllToAllDispatcher, LocalDispatcher, build_route_map, combine, permute, swiglu_experts

sys.path.insert(0, str(Path(__file__).parent))
import kernels_spawn  # noqa: E402

WORLD = 3
E, D, H = 6, 8, 4  # two experts per EP rank
DEADLINE_S = 120
COLLECTIVE_TIMEOUT_S = 20


def _inputs(seed: int, tokens: tuple[int, ...], dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, D, generator=g).to(dtype) for t in tokens]
    router = torch.randn(E, D, generator=g) * 0.5
    w1 = (torch.randn(E, D, 2 * H, generator=g) * D**-0.5).to(dtype)
    w2 = (torch.randn(E, H, D, generator=g) * H**-0.5).to(dtype)
    return xs, router, w1, w2


def _layer(dispatcher, x, router, w1, w2, k, keep=None):  # noqa: ANN001
    """Router (fp32 softmax, top-k), dispatch, SwiGLU experts, combine. keep: [T, k] mask of the rows a capacity
    keeps (the one-process reference zeroes the router weight of the others)."""
    probs = (x.float() @ router.t()).softmax(-1)
    weights, ids = probs.topk(k, dim=-1)
    if keep is not None:
        weights = weights * keep
    rm = build_route_map(ids, E)
    if keep is not None:  # the reference: every expert here, rows in expert order
        return combine(swiglu_experts(permute(x, rm), w1, w2, rm.offsets), rm, weights), None
    result = dispatcher.dispatch(x, rm)
    return dispatcher.combine(swiglu_experts(result.rows, w1, w2, result.offsets), result, weights), result


def _grads(run, x, router, w1, w2) -> list[torch.Tensor]:  # noqa: ANN001
    leaves = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    y, result = run(*leaves)
    y.float().square().sum().backward()
    return [y.detach(), *(t.grad for t in leaves)], result


def _errors(rank: int, tokens: tuple[int, ...], got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """Max abs error of out, x grad (this rank's rows), router grad (summed over ranks), expert grads (this
    rank's experts, summed over the ranks' tokens by the dispatcher's backward)."""
    lo, e_local = sum(tokens[:rank]), E // WORLD
    router_grad = got[2].clone()
    dist.all_reduce(router_grad)
    rows, experts = slice(lo, lo + tokens[rank]), slice(rank * e_local, (rank + 1) * e_local)
    pairs = [(got[0], want[0][rows]), (got[1], want[1][rows]), (router_grad, want[2]),
             (got[3], want[3][experts]), (got[4], want[4][experts])]
    return [(a.float() - b.float()).abs().max().item() if a.numel() else 0.0 for a, b in pairs]


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    e_local = E // WORLD
    return t[rank * e_local:(rank + 1) * e_local]


def _two_layers(rank: int, mode: str, dtype: torch.dtype) -> list[float]:
    tokens = (5, 0, 7)
    xs, router, w1, w2 = _inputs(1, tokens, dtype)
    dispatcher = AllToAllDispatcher(dist.group.WORLD, E)

    def ep(x, r, a, b):  # noqa: ANN001
        def body(h):  # noqa: ANN001
            for _ in range(2):  # two layers, one dispatcher
                h, _ = _layer(dispatcher, h, r, a, b, 2)
            return h
        if mode == "plain":
            return body(x), None
        return checkpoint.checkpoint(body, x, use_reentrant=mode == "reentrant"), None

    def ref(x, r, a, b):  # noqa: ANN001
        for _ in range(2):
            x, _ = _layer(LocalDispatcher(E), x, r, a, b, 2)
        return x, None

    got, _ = _grads(ep, xs[rank], router, _local(w1, rank), _local(w2, rank))
    want, _ = _grads(ref, torch.cat(xs), router, w1, w2)
    return _errors(rank, tokens, got, want)


def _kept(ids_of_ranks: list[torch.Tensor], tokens: tuple[int, ...], k: int, c: float) -> tuple[list, list[int]]:
    """The docstring's rule: receiving rank r computes the first ceil(c * mean(T) * k) rows in (local expert, source
    rank, token, slot) order and drops the rest. Per source rank its [T, k] keep mask; per rank its dropped count."""
    e_local = E // WORLD
    keep = [torch.ones(t, k) for t in tokens]
    dropped = []
    for r in range(WORLD):
        rows = sorted((int(e) % e_local, s, t, j) for s, ids in enumerate(ids_of_ranks)
                      for t in range(ids.shape[0]) for j, e in enumerate(ids[t].tolist()) if int(e) // e_local == r)
        cap = math.ceil(Fraction(str(c)) * Fraction(sum(tokens) * k, len(tokens)))  # c as written: 0.45, not 0.4500..1
        for _, s, t, j in rows[cap:]:
            keep[s][t, j] = 0.0
        dropped.append(max(len(rows) - cap, 0))
    return keep, dropped


def _capacity(rank: int) -> dict:
    tokens, k, c = (4, 0, 5), E, 0.45  # top_k = E: every token reaches every rank; capacity ceil(0.45 * 18) = 9
    xs, router, w1, w2 = _inputs(2, tokens, torch.float32)
    dispatcher = AllToAllDispatcher(dist.group.WORLD, E, capacity_factor=c)
    got, result = _grads(lambda *a: _layer(dispatcher, *a, k), xs[rank], router, _local(w1, rank), _local(w2, rank))
    keep, dropped = _kept([(x @ router.t()).softmax(-1).topk(k, dim=-1).indices for x in xs], tokens, k, c)
    want, _ = _grads(lambda *a: _layer(None, *a, k, keep=torch.cat(keep)), torch.cat(xs), router, w1, w2)
    return {"errors": _errors(rank, tokens, got, want), "dropped": int(result.dropped), "want_dropped": dropped[rank],
            "kept": result.rows.shape[0]}


def _capacity_refusals() -> dict:
    out = {}
    for name, value in (("bool", True), ("none", None)):
        try:
            AllToAllDispatcher(dist.group.WORLD, E, capacity_factor=value)
            out[name] = "accepted"
        except Exception as e:  # noqa: BLE001 - the test checks which error, and its message
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _cases(rank: int) -> dict:
    res = {}
    for mode in ("plain", "non_reentrant", "reentrant"):
        res[f"two_layers_{mode}"] = _two_layers(rank, mode, torch.float32)
    res["two_layers_bf16"] = _two_layers(rank, "non_reentrant", torch.bfloat16)
    res["capacity"] = _capacity(rank)
    res["refusals"] = _capacity_refusals()
    return res


def _entry(rank: int, port: int, out_dir: str) -> None:
    kernels_spawn.run_gloo_rank(rank, port, out_dir, WORLD, COLLECTIVE_TIMEOUT_S, _cases)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir: Path = tmp_path_factory.mktemp("qa53")
    return kernels_spawn.results_without_errors(__file__, WORLD, out_dir, DEADLINE_S)


@pytest.mark.parametrize(("case", "tol"), [("two_layers_plain", 1e-5), ("two_layers_non_reentrant", 1e-5),
                                           ("two_layers_reentrant", 1e-5), ("two_layers_bf16", 2e-2)])
def test_two_layers_sharing_a_dispatcher_on_three_ranks_match_one_process_with_and_without_recompute(
        ranks, case, tol):
    for r, res in enumerate(ranks):
        assert max(res[case]) <= tol, f"rank {r}: out, x, router, w_gate_up, w_down errors {res[case]}"


def test_capacity_keeps_the_documented_rows_on_three_ranks_and_a_rank_without_tokens_keeps_as_many(ranks):
    for r, res in enumerate(ranks):
        got = res["capacity"]
        assert max(got["errors"]) <= 1e-5, f"rank {r}: {got['errors']}"
        assert got["dropped"] == got["want_dropped"], f"rank {r}: {got}"
    # every rank receives 9 tokens' rows for its 2 experts (18) and keeps ceil(0.45 * 54 / 3) = 9, the rank without
    # tokens too (0 kept before moe-kernels 0.10.0)
    for r, res in enumerate(ranks):
        assert res["capacity"]["kept"] == 9 and res["capacity"]["dropped"] == 9 * (E // WORLD) - 9, (r, res["capacity"])


@pytest.mark.parametrize(("name", "shown"), [("bool", "True"), ("none", "None")])
def test_a_capacity_factor_that_is_no_number_is_refused_naming_it(ranks, name, shown):
    for r, res in enumerate(ranks):
        want = f"ValueError: capacity_factor={shown} must be a finite number >= 0 (0 = dropless)"
        assert res["refusals"][name] == want, f"rank {r}: {res['refusals'][name]}"
