"""Where a single MoE block call from an idle GPU loses time: host issue time per phase and the
GPU's idle gaps, for our block (auto plan) and the dense chain, on the block bench's shapes.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/host_timeline.py --shapes a --experts 128

Prints, per method: host ms to issue the route map, the forward and the backward (perf_counter,
GPU idle at the start); GPU ms of the call (CUDA events); and from a profiler trace of one call,
the GPU idle time before the first kernel, between kernels (gaps over 5 us, largest first, with
the kernels either side), and the kernel-busy total.
"""

from __future__ import annotations

import argparse
import time

import torch

import moe_kernels as moe
from bench_moe_block import SHAPES, dense, make_inputs


def phases_ours(args, E):
    ids, weights, x, w1, w2, gy = args
    t0 = time.perf_counter()
    rm = moe.build_route_map(ids, E)
    t1 = time.perf_counter()
    out = moe.moe_ffn(x, rm, weights, w1, w2)
    t2 = time.perf_counter()
    torch.autograd.grad(out, (x, weights, w1, w2), gy)
    t3 = time.perf_counter()
    return {"route_map": t1 - t0, "forward": t2 - t1, "backward": t3 - t2}


def phases_dense(args):
    xd, w1d, w2d, gyd = args
    t0 = time.perf_counter()
    dense(xd, w1d, w2d, gyd)
    return {"forward+backward": time.perf_counter() - t0}


def gpu_ms(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def gaps(fn):
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t_start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                     key=lambda e: e.time_range.start)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    first_cpu = min(e.time_range.start for e in cpu)
    busy = sum(k.time_range.elapsed_us() for k in kernels)
    span = kernels[-1].time_range.end - first_cpu
    holes = []
    for p, q in zip(kernels, kernels[1:]):
        g = q.time_range.start - p.time_range.end
        if g > 5:
            holes.append((g, p.name[:50], q.name[:50]))
    holes.sort(reverse=True)
    return dict(before_first_kernel_us=kernels[0].time_range.start - first_cpu, span_us=span, kernel_busy_us=busy,
                n_kernels=len(kernels), gaps=holes[:12], gap_total_us=sum(h[0] for h in holes))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="a,b")
    p.add_argument("--experts", default="8,128")
    args = p.parse_args()
    for name in args.shapes.split(","):
        for E in map(int, args.experts.split(",")):
            s = SHAPES[name]
            T, d, h, k = s["T"], s["d"], s["h"], s["k"]
            ids, weights, x, w1, w2, gy = make_inputs(T, d, h, k, E, 0)
            for t in (x, weights, w1, w2):
                t.requires_grad_()
            ours_args = (ids, weights, x, w1, w2, gy)
            xd = torch.randn(T * k, d, device="cuda").bfloat16().requires_grad_()
            w1d = (torch.randn(d, 2 * h, device="cuda") / d**0.5).bfloat16().requires_grad_()
            w2d = (torch.randn(h, d, device="cuda") / h**0.5).bfloat16().requires_grad_()
            dense_args = (xd, w1d, w2d, torch.randn(T * k, d, device="cuda").bfloat16())
            for _ in range(3):
                phases_ours(ours_args, E), phases_dense(dense_args)
            for label, ph, fn in (("ours", lambda: phases_ours(ours_args, E), lambda: phases_ours(ours_args, E)),
                                  ("dense", lambda: phases_dense(dense_args), lambda: phases_dense(dense_args))):
                host = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    host.append(ph())
                    torch.cuda.synchronize()
                med = {key: sorted(hh[key] for hh in host)[2] * 1e3 for key in host[0]}
                g = sorted(gpu_ms(fn) for _ in range(5))[2]
                tl = gaps(fn)
                print(f"\n=== shape {name} E={E} {label}: call {g:.3f} ms (events), host issue ms "
                      + ", ".join(f"{key} {v:.3f}" for key, v in med.items()))
                print(f"    profiled: first kernel after {tl['before_first_kernel_us']:.0f} us, span {tl['span_us']:.0f} us, "
                      f"kernels busy {tl['kernel_busy_us']:.0f} us in {tl['n_kernels']} kernels, gaps >5us total {tl['gap_total_us']:.0f} us")
                for gap in tl["gaps"]:
                    print(f"      gap {gap[0]:7.0f} us  after {gap[1]}  before {gap[2]}")


if __name__ == "__main__":
    main()
