"""QA 151: checks a mutation audit of moe-parallel (review helper 165) found no test making. Each fails on its mutant:
- `DistributedAdamW.step`'s `not math.isfinite(norm)` narrowed to `math.isnan(norm)`: an Inf gradient was applied
  (NaN weights with grad_clip=0, a ZeroDivisionError with a clip) instead of skipping the step;
- `FlatParams`' bucket split `> bucket_numel` made `>=`: parameters that exactly fill bucket_numel split into two
  buckets (one more collective a step; bucket_numel is documented as the most a bucket holds).
One spawned gloo rank (a world of one) runs both."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("qa151_worker")
parallel_spawn = importlib.import_module("parallel_spawn")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    (res,) = parallel_spawn.run_ranks(worker.run_rank, 1, tmp_path_factory.mktemp("qa151"), 120)
    return res


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_an_infinite_gradient_skips_the_step_and_keeps_the_weights(results, clip):
    got = results["inf_gradient_skips_the_step"][clip]
    assert got == {"skipped": True, "skipped_steps": 1, "step_count": 0, "kept": True}, got


def test_parameters_that_exactly_fill_bucket_numel_share_one_bucket(results):
    assert results["buckets_of_exactly_bucket_numel"] == {"buckets": 1}
