"""Route map on one GPU: our triton kernels (histogram, scan, scatter, device-side id check)
against the torch backend (bincount-style scatter_add + stable sort), in one run.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/bench_route_map.py \
        --out packages/moe-kernels/bench/results/h200_route_map.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
import triton.testing

import moe_kernels as moe

CASES = [(16384, 8, 8), (16384, 8, 32), (16384, 8, 128), (16384, 4, 128), (16384, 8, 256), (65536, 8, 128)]


def time_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default=None, help="the commit measured (git on the GPU machine may not know it)")
    args = parser.parse_args()
    rows = []
    for T, k, E in CASES:
        g = torch.Generator(device="cuda").manual_seed(T + E)
        ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
        ref = moe.build_route_map(ids, E, backend="torch")
        out = moe.build_route_map(ids, E, backend="triton")
        same = all(torch.equal(getattr(ref, n), getattr(out, n)) for n in ("counts", "offsets", "sort_order", "dest_row"))
        row = dict(T=T, k=k, E=E, equal_to_torch=same,
                   triton_us=time_us(lambda: moe.build_route_map(ids, E, backend="triton")),
                   torch_us=time_us(lambda: moe.build_route_map(ids, E, backend="torch")))
        rows.append(row)
        print(row, flush=True)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, commit=commit, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
