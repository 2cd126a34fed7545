"""Host time of one block call, function by function (cProfile): what the host does while an idle GPU waits at the
start of a call (explore_call_gaps.py: 0.3-0.6 ms between the route map's last kernel and the permute).

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_host_profile.py --shape a --experts 128
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import moe_kernels as moe
from bench_moe_block import SHAPES, make_inputs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="a")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    s = SHAPES[args.shape]
    ids, weights, x, w1, w2, gy = make_inputs(s["T"], s["d"], s["h"], s["k"], args.experts, 0)
    for t in (x, weights, w1, w2):
        t.requires_grad_()
    E = args.experts

    def route_and_forward():
        rm = moe.build_route_map(ids, E)
        return moe.moe_ffn(x, rm, weights, w1, w2)

    for _ in range(3):
        torch.autograd.grad(route_and_forward(), (x, weights, w1, w2), gy)
    torch.cuda.synchronize()
    host = {"route_map": [], "forward": [], "backward": []}
    prof = cProfile.Profile()
    for _ in range(args.calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        rm = moe.build_route_map(ids, E)
        t1 = time.perf_counter()
        out = moe.moe_ffn(x, rm, weights, w1, w2)
        t2 = time.perf_counter()
        torch.autograd.grad(out, (x, weights, w1, w2), gy)
        prof.disable()
        t3 = time.perf_counter()
        host["route_map"].append(t1 - t0)
        host["forward"].append(t2 - t1)
        host["backward"].append(t3 - t2)
    torch.cuda.synchronize()
    # host time per phase without the profiler
    clean = {"route_map": [], "forward": [], "backward": []}
    for _ in range(args.calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rm = moe.build_route_map(ids, E)
        t1 = time.perf_counter()
        out = moe.moe_ffn(x, rm, weights, w1, w2)
        t2 = time.perf_counter()
        torch.autograd.grad(out, (x, weights, w1, w2), gy)
        t3 = time.perf_counter()
        clean["route_map"].append(t1 - t0)
        clean["forward"].append(t2 - t1)
        clean["backward"].append(t3 - t2)
    for label, d in (("host ms, no profiler", clean), ("host ms, under cProfile", host)):
        print(label + ": " + ", ".join(f"{k} {sorted(v)[len(v) // 2] * 1e3:.3f}" for k, v in d.items()))
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(35)
        print(f"--- by {key} ({args.calls} calls)")
        print(out.getvalue())


if __name__ == "__main__":
    main()
