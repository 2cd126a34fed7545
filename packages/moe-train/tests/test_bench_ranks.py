"""`moe-train bench` under torchrun: one report from rank 0 whose numbers cover every rank, and one
writer of --out (every rank used to print its own JSON and write the same file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import bench_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402


def test_bench_under_two_ranks_reports_once_for_the_whole_job(tmp_path):
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    report = tmp_path / "bench.json"
    mp.spawn(h.run_guarded, args=(w.bench_rank, str(out_dir), h.free_port(), str(report)), nprocs=2, join=True)
    ranks = h.load_results(out_dir, 2)
    assert [r["status"] for r in ranks] == [0, 0]
    assert ranks[1]["printed"] == ""
    printed = json.loads(ranks[0]["printed"])
    assert json.loads(report.read_text()) == printed
    assert printed["world_size"] == 2 and "rank" not in printed
    # every rank's tokens over the slowest rank's time: at most twice this rank's rate
    assert 0 < printed["tokens_per_s_all_ranks"] <= 2 * printed["tokens_per_s"] * 1.0001
