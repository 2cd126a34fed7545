"""bench/cast_bandwidth.py runs (CPU smoke check: both sides are torch's cast there) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cast_bandwidth.py"


def test_the_cast_bench_writes_both_sides_and_its_provenance(tmp_path):
    out = tmp_path / "c.json"
    run = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--numel", "4097", "--reps", "2",
                          "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert set(result["tb_per_s"]) == {"triton_upcast", "torch_to"}
    assert all(v > 0 for v in result["tb_per_s"].values())
    assert result["numel"] == 4097 and result["device"] and result["torch"] and "--numel 4097" in result["command"]


def test_the_cast_bench_refuses_a_size_it_cannot_time(tmp_path):
    run = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--numel", "0"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "--numel=0" in run.stderr
