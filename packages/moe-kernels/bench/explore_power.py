"""SM clock and board power while the MoE block and the dense chain run under sustained load.

The H200 is power-capped under these loads (results/h200_moe_block_clocks.csv). This script
asks whether E=128 is slower than E=8 because its kernels do less per clock or because its
extra weight traffic (16x the weight bytes per FLOP of E=8) costs power, so the clock drops.
Each method runs back to back for `--seconds` per phase, phases interleaved over `--rounds`,
while nvidia-smi samples the SM clock and power every 50 ms; the report gives TFLOP/s, mean
clock, mean power and TFLOP/s per GHz per phase.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 packages/moe-kernels/bench/explore_power.py --shape b
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench_moe_block import SHAPES, dense, make_inputs, ours  # noqa: E402  (run from bench/ or with it on sys.path)


def phase(fn, seconds):
    """Run fn back to back for about `seconds`; returns (start, end, calls) in wall-clock time."""
    fn()
    torch.cuda.synchronize()
    start, calls = dt.datetime.now(), 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
    return start, dt.datetime.now(), calls


def read_samples(path):
    out = []
    for line in Path(path).read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            t = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            out.append((t, float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="b")
    p.add_argument("--experts", default="8,128")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--commit", default=None)
    args = p.parse_args()
    s = SHAPES[args.shape]
    T, d, h, k = s["T"], s["d"], s["h"], s["k"]
    flops = 18 * T * k * d * h
    fns = {}
    for E in map(int, args.experts.split(",")):
        ids, weights, x, w1, w2, gy = make_inputs(T, d, h, k, E, 0)
        for t in (x, weights, w1, w2):
            t.requires_grad_()
        a = (ids, weights, x, w1, w2, gy, E)
        fns[f"ours E={E}"] = lambda a=a: ours(*a)
        for _ in range(3):
            fns[f"ours E={E}"]()  # tuning outside the phases
    g = torch.Generator(device="cuda").manual_seed(1)
    xd = torch.randn(T * k, d, device="cuda", generator=g).bfloat16().requires_grad_()
    w1d = (torch.randn(d, 2 * h, device="cuda", generator=g) / d**0.5).bfloat16().requires_grad_()
    w2d = (torch.randn(h, d, device="cuda", generator=g) / h**0.5).bfloat16().requires_grad_()
    gyd = torch.randn(T * k, d, device="cuda", generator=g).bfloat16()
    fns["dense"] = lambda: dense(xd, w1d, w2d, gyd)
    log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50", "-f", log])
    time.sleep(1.0)
    phases = []
    try:
        for r in range(args.rounds):
            for name, fn in fns.items():
                start, end, calls = phase(fn, args.seconds)
                phases.append(dict(method=name, round=r, start=start, end=end, calls=calls))
                time.sleep(0.5)
    finally:
        time.sleep(0.5)
        smi.terminate()
        smi.wait()
    samples = read_samples(log)
    rows = []
    for ph in phases:
        inside = [(c, w) for t, c, w in samples if ph["start"] <= t <= ph["end"]]
        wall = (ph["end"] - ph["start"]).total_seconds()
        tflops = flops * ph["calls"] / wall / 1e12
        clock = sum(c for c, _ in inside) / max(1, len(inside))
        power = sum(w for _, w in inside) / max(1, len(inside))
        rows.append(dict(method=ph["method"], round=ph["round"], calls=ph["calls"], seconds=wall, tflops=tflops,
                         samples=len(inside), sm_mhz=clock, power_w=power, tflops_per_ghz=tflops / (clock / 1000) if clock else None))
        print(f"{ph['method']:>12} r{ph['round']}: {tflops:6.1f} TFLOP/s  {clock:6.0f} MHz  {power:5.0f} W  "
              f"{rows[-1]['tflops_per_ghz'] or 0:6.1f} TFLOP/s/GHz  ({len(inside)} samples)")
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit, shape=args.shape,
                    command="python3 packages/moe-kernels/bench/explore_power.py " + " ".join(f"--{k}={v}" for k, v in vars(args).items() if v is not None and k != "out"))
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=1, default=str))


if __name__ == "__main__":
    main()
