"""Local search over block plans, timed as whole blocks.

A block plan says, GEMM by GEMM, which implementation runs it. GEMMs timed one by one do not add
up to the block (L2 reuse, launch gaps, and on a power-capped GPU the clock follows the whole
mix of kernels), so the block's own forward+backward time decides. Timing every plan is too
slow (144 plans), so the search starts from the fastest of a few seeds and then tries every plan
that differs from the current best in one GEMM, keeping a change only when it is faster by more
than `min_gain` (a margin against timing noise). No triton import here: the search logic runs
and is tested on the CPU with any cost function.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, Hashable, Iterable, Sequence, TypeVar

Plan = TypeVar("Plan", bound=Hashable)


def one_change_neighbours(plan: Plan, options: dict[str, Sequence[str]]) -> list[Plan]:
    """Every plan that differs from `plan` in exactly one field, over `options` (field -> values)."""
    return [replace(plan, **{f.name: v}) for f in fields(plan) for v in options.get(f.name, ()) if v != getattr(plan, f.name)]


def search_plan(
    seeds: Iterable[Plan],
    measure: Callable[[list[Plan]], dict[Plan, float]],
    options: dict[str, Sequence[str]],
    min_gain: float = 0.01,
    max_passes: int = 2,
) -> tuple[Plan, dict[Plan, float]]:
    """The fastest plan found, and every time measured (plan -> seconds or ms, smaller is better).

    `measure(plans)` times the plans side by side (interleaved, so a clock drift favours none)
    and returns a time per plan. A sweep goes GEMM by GEMM and times each other implementation
    of that GEMM in the best plan so far, beside it; every plan is measured once; at most
    `max_passes` sweeps, fewer when a sweep changes nothing."""
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    seeds = list(dict.fromkeys(seeds))
    if not seeds:
        raise ValueError("search_plan needs at least one seed plan")
    seen = measure(seeds)
    best = min(seeds, key=seen.__getitem__)
    tried = set(seeds)
    for _ in range(max_passes):
        changed = False
        for f in fields(best):
            for value in options.get(f.name, ()):
                cand = replace(best, **{f.name: value})  # one GEMM away from the best so far
                if cand in tried:
                    continue
                tried.add(cand)
                times = measure([best, cand])
                seen[cand] = times[cand]
                if times[cand] < times[best] * (1.0 - min_gain):
                    best, changed = cand, True
        if not changed:
            break
    return best, seen
