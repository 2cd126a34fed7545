"""bench_moe_block.py judges its rows against the block targets (ours >= 0.85 x dense everywhere, >= 1.2 x the torch
grouped_mm block on (a) and >= 1.0 x on (b), E=128 at most 5% below E=8), and --judge re-reads a results JSON
without a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
spec = importlib.util.spec_from_file_location("bench_moe_block", BENCH / "bench_moe_block.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _row(shape: str, E: int, ours: float, dense: float, torch_block: float) -> dict:
    return {"shape": shape, "E": E, "ours": {"tflops": ours}, "dense": {"tflops": dense},
            "torch_grouped_mm": {"tflops": torch_block}}


def test_verdicts_meet_each_target_at_its_bound_and_miss_just_below_it():
    rows = [_row("a", 8, 100.0, 100 / 0.85, 100 / 1.2), _row("a", 128, 95.0, 95 / 0.849, 95 / 1.199),
            _row("b", 8, 100.0, 100.0, 100.0), _row("b", 128, 94.9, 100.0, 94.91)]
    got = bench.verdicts(rows, "tflops")
    assert got == [
        "  target (a) E=8 ours/dense: 0.850 met (>= 0.85)",
        "  target (a) E=8 ours/torch: 1.200 met (>= 1.2)",
        "  target (a) E=128 ours/dense: 0.849 MISSED (>= 0.85)",
        "  target (a) E=128 ours/torch: 1.199 MISSED (>= 1.2)",
        "  target (b) E=8 ours/dense: 1.000 met (>= 0.85)",
        "  target (b) E=8 ours/torch: 1.000 met (>= 1.0)",
        "  target (b) E=128 ours/dense: 0.949 met (>= 0.85)",
        "  target (b) E=128 ours/torch: 1.000 MISSED (>= 1.0)",
        "  target (a) ours E=128 vs E=8: -5.0% met (at most 5% below)",
        "  target (b) ours E=128 vs E=8: -5.1% MISSED (at most 5% below)",
    ]


def test_verdicts_skip_what_the_rows_cannot_judge():
    rows = [{"shape": "a", "E": 32, "ours": {"tflops": 1.0}}, {"shape": "b", "E": 8, "dense": {"tflops": 1.0}}]
    assert bench.verdicts(rows, "tflops") == []


def test_judge_reads_the_committed_h200_table_without_a_gpu(monkeypatch, capsys):
    table = BENCH / "results" / "h200_moe_block_0.8.0.json"
    monkeypatch.setattr(sys, "argv", ["bench_moe_block.py", "--judge", str(table)])
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    assert "  target (b) ours E=128 vs E=8: -16.3% MISSED (at most 5% below)" in lines
    assert "  target (a) E=128 ours/torch: 1.869 met (>= 1.2)" in lines
    assert sum("target" in line for line in lines) == 2 * 14  # both columns: 12 per-row targets and 2 E=128 vs E=8
