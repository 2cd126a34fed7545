"""What the bench/explore_gluon_*.py scripts share: the block's shapes with random top-k routing, median
timings of several methods in interleaved rounds (each sees the same GPU clocks), and the JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import torch
import triton

SHAPES = {"b": (16384, 4096, 4096, 4), "a": (16384, 2048, 1024, 8)}  # T, d, h, k


def median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def routed_problems(experts: tuple[int, ...]) -> Iterator[tuple[str, int, int, int, int, torch.Tensor, torch.Generator]]:
    """(shape, T, d, h, k, E, offsets, generator) per shape and expert count: random top-k routing (seed 0); the
    generator, already advanced past the routing, then draws the operands."""
    for name, (T, d, h, k) in SHAPES.items():
        for E in experts:
            g = torch.Generator(device="cuda").manual_seed(0)
            ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices.reshape(-1)
            offs = torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)
            yield name, T, d, h, k, E, offs, g


def interleaved_tflops(methods: dict[str, Callable[[], object]], flops: int, rounds: int = 2):
    """Every method timed once per round, rounds one after another; (ms per round, TFLOP/s of the best round)."""
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(rounds):
        for m, fn in methods.items():
            times[m].append(median_ms(fn))
    return times, {m: flops / min(t) / 1e9 for m, t in times.items()}


def write_report(results: list[dict], script: str) -> None:
    """The JSON report (GPU, versions, commit, command, rows) to the path given as the script's argument, if any."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, commit=commit,
               command=f"PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/{script} OUT",
               results=results)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(doc, f, indent=1)
