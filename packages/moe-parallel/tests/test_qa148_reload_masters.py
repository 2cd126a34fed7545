"""QA 148: DistributedAdamW.reload_masters, public and documented ("masters from weights loaded elsewhere"), was called
by no test and no code. A mutation audit (review helper 161) made it read every rank's master from the first shard
(bucket.start for shard_start) and nothing failed; on 2 ranks that corrupts every rank's weights but rank 0's at the
next refresh. Here: weights loaded on 2 ranks (odd bucket and shard sizes), reload_masters, refresh_weights gives the
loaded weights back bit for bit, and one step equals torch.optim.AdamW's from the loaded weights."""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("qa148_worker")
parallel_spawn = importlib.import_module("parallel_spawn")


def test_reload_masters_reads_each_ranks_own_shard_of_the_loaded_weights(tmp_path):
    results = parallel_spawn.run_ranks(functools.partial(worker.run_rank, case="reload_then_step"), 2, tmp_path, 120)
    for rank, r in enumerate(results):
        got = r["reload_then_step"]
        assert got["kept"], (rank, got)
        assert got["gap"] < 1e-6, (rank, got)  # fp32 AdamW against torch's: summation order only
