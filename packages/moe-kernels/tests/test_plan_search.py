"""The block-plan search (plan_search.search_plan) on cost functions with known optima."""

import itertools
import random

import pytest

pytest.importorskip("triton")

from moe_kernels.plan_search import one_change_neighbours, search_plan  # noqa: E402
from moe_kernels.triton.ffn_kernels import ALL_GROUPED_MM, ALL_TRITON, PLAN_OPTIONS, BlockPlan  # noqa: E402


def every_plan():
    names = list(PLAN_OPTIONS)
    return [BlockPlan(**dict(zip(names, values))) for values in itertools.product(*PLAN_OPTIONS.values())]


def additive_cost(seed):
    """A random cost per (GEMM, implementation), summed over the plan: a block whose GEMMs add up."""
    rng = random.Random(seed)
    table = {(name, opt): rng.uniform(1.0, 3.0) for name, opts in PLAN_OPTIONS.items() for opt in opts}
    return lambda plan: sum(table[(name, getattr(plan, name))] for name in PLAN_OPTIONS)


def measuring(cost, log):
    def measure(plans):
        log.append(list(plans))
        return {p: cost(p) for p in plans}

    return measure


def test_neighbours_differ_in_exactly_one_gemm():
    neighbours = one_change_neighbours(ALL_TRITON, PLAN_OPTIONS)
    assert len(neighbours) == sum(len(v) - 1 for v in PLAN_OPTIONS.values()) == 8
    for plan in neighbours:
        assert sum(getattr(plan, n) != getattr(ALL_TRITON, n) for n in PLAN_OPTIONS) == 1


@pytest.mark.parametrize("seed", range(6))
def test_search_finds_the_optimum_when_gemm_times_add_up(seed):
    cost = additive_cost(seed)
    log = []
    best, seen = search_plan([ALL_TRITON, ALL_GROUPED_MM], measuring(cost, log), PLAN_OPTIONS, min_gain=0.0)
    assert best == min(every_plan(), key=cost)
    assert len(seen) <= 2 + 2 * 8  # each plan measured once: seeds, then at most two sweeps
    assert all(len(call) <= 2 for call in log[1:])  # a candidate is timed beside the current best


def test_search_repairs_a_seed_that_lost_on_an_interaction():
    """GEMMs that are fast alone but slow together (the by-GEMM seed) lose to all-grouped_mm;
    the search then keeps the one GEMM that does pay off on its own."""
    by_gemm = BlockPlan("grouped_mm", "triton", "grouped_mm", "grouped_mm", "triton", "grouped_mm")

    def cost(plan):
        t = 10.0
        t -= 0.5 * (plan.dgrad1 == "triton")
        t -= 0.05 * (plan.fwd2 == "triton")  # alone: inside the 1% margin
        t += 1.0 * (plan.fwd2 == "triton" and plan.dgrad1 == "triton")  # together they lose
        t += 3.0 * (plan.fwd1 == "fused") + 3.0 * (plan.dgrad2 == "fused")
        return t

    best, _ = search_plan([by_gemm, ALL_TRITON, ALL_GROUPED_MM], measuring(cost, []), PLAN_OPTIONS, min_gain=0.01)
    assert best == BlockPlan("grouped_mm", "grouped_mm", "grouped_mm", "grouped_mm", "triton", "grouped_mm")


def test_changes_inside_the_noise_margin_are_not_taken():
    def cost(plan):  # every other plan 0.5% faster than all-grouped_mm: below a 1% margin
        return 1.0 if plan == ALL_GROUPED_MM else 0.995

    best, _ = search_plan([ALL_GROUPED_MM], measuring(cost, []), PLAN_OPTIONS, min_gain=0.01)
    assert best == ALL_GROUPED_MM
    best, _ = search_plan([ALL_GROUPED_MM], measuring(cost, []), PLAN_OPTIONS, min_gain=0.001)
    assert best != ALL_GROUPED_MM


def test_restricted_options_are_respected():
    options = dict(PLAN_OPTIONS, fwd1=("fused", "grouped_mm"))
    seen_plans = []

    def measure(plans):
        seen_plans.extend(plans)
        return {p: additive_cost(3)(p) for p in plans}

    search_plan([ALL_TRITON], measure, options)
    assert all(p.fwd1 != "triton" for p in seen_plans)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2.0])
def test_bad_margin_is_refused(bad):
    with pytest.raises(ValueError, match="min_gain"):
        search_plan([ALL_TRITON], lambda plans: {p: 1.0 for p in plans}, PLAN_OPTIONS, min_gain=bad)


def test_no_seed_is_refused():
    with pytest.raises(ValueError, match="at least one seed"):
        search_plan([], lambda plans: {p: 1.0 for p in plans}, PLAN_OPTIONS)
