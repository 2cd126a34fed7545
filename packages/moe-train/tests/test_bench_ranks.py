"""`moe-train bench` under torchrun: one report from rank 0 whose numbers cover every rank, and one
writer of --out (every rank used to print its own JSON and write the same file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
import bench_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402


def test_bench_under_two_ranks_reports_once_for_the_whole_job(tmp_path):
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    report = tmp_path / "bench.json"
    h.start_ranks(h.run_guarded, args=(w.bench_rank, str(out_dir), h.free_port(), str(report)), nprocs=2)
    ranks = h.load_results(out_dir, 2)
    assert [r["status"] for r in ranks] == [0, 0]
    assert ranks[1]["printed"] == ""
    printed = json.loads(ranks[0]["printed"])
    assert json.loads(report.read_text()) == printed
    assert printed["world_size"] == 2 and "rank" not in printed
    # every rank's tokens over the slowest rank's time: at most twice this rank's rate
    assert 0 < printed["tokens_per_s_all_ranks"] <= 2 * printed["tokens_per_s"] * 1.0001


def test_max_over_ranks_takes_each_numbers_largest_in_one_collective():
    """bench reports the slowest rank's time and the largest peak memory through trainer.metrics.max_over_ranks
    (it had its own copy for two numbers; the shared one took one). The collective is faked: each rank's sum
    adds the other ranks' slots."""
    import torch

    from moe_train.trainer.metrics import max_over_ranks

    per_rank = [[1.5, 0.0], [4.0, 2.0], [2.5, 7.0]]
    calls = []

    def sum_with_others(rank):
        def all_reduce_sum(slots):
            calls.append(rank)
            others = torch.tensor([[v if r != rank else 0.0 for r, v in enumerate(col)] for col in zip(*per_rank)],
                                  dtype=torch.float64)
            return slots + others
        return all_reduce_sum

    cpu = torch.device("cpu")
    got = [max_over_ranks(v, rank, 3, sum_with_others(rank), cpu) for rank, v in enumerate(per_rank)]
    assert got == [[4.0, 7.0]] * 3 and calls == [0, 1, 2]
    assert max_over_ranks([1.5, 0.25], 0, 1, sum_with_others(0), cpu) == [1.5, 0.25] and calls == [0, 1, 2]
