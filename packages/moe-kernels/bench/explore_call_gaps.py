"""Where a block call's wall time goes beyond its kernels: idle GPU time inside a call, allocator activity
and kernel time, for ours and the dense chain, in the bench's own setting (bench_moe_block.py's inputs and
methods, timed in interleaved rounds, so the caching allocator holds what the other methods left).

The question it answers: at (b) E=128 a profile of three isolated calls put our kernels at 35.8 ms a call against
the dense chain's 32.4 (0.905), while the bench's event timings read 39.4 / 38.1 ms against 32.6 / 33.3 (0.83 /
0.87). Either the GPU idles inside our calls in the bench, or the clocks differ, or the allocator works.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_call_gaps.py --out gaps.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from bench_moe_block import SHAPES, dense, make_inputs, median, ours, sample_ms, torch_grouped_mm_block

ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")


def alloc_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, -1)) for k in ALLOC_KEYS}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def profiled(fn, calls: int) -> dict:
    """One profiled sample: event-timed ms per call, kernel time, GPU span and idle inside it, the largest gaps
    (with the kernels around them) and the runtime calls that can stall (allocations, synchronisations)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        ms = sample_ms(fn, calls)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e)
    runtime = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and any(w in e["name"] for w in ("Malloc", "Free", "ynchronize")):
            runtime.setdefault(e["name"], [0, 0.0])
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e.get("dur", 0.0) / 1000
    span = (kernels[-1][1] - kernels[0][0]) / 1000 if kernels else 0.0
    busy = busy_union([(s, e) for s, e, _ in kernels]) / 1000
    gaps = sorted(((kernels[i + 1][0] - kernels[i][1]) / 1000, kernels[i][2][:60], kernels[i + 1][2][:60])
                  for i in range(len(kernels) - 1))[::-1][:6]
    return {"calls": calls, "event_ms_per_call": ms, "kernel_ms_per_call": sum(e - s for s, e, _ in kernels) / 1000 / calls,
            "gpu_span_ms_per_call": span / calls, "gpu_idle_in_span_ms_per_call": (span - busy) / calls,
            "largest_gaps_ms": [[round(g, 3), a, b] for g, a, b in gaps],
            "runtime_stalls": {k: [n, round(ms_, 3)] for k, (n, ms_) in runtime.items()}}


def run_case(name: str, E: int, rounds: int, b2b: int) -> dict:
    s = SHAPES[name]
    T, d, h, k = s["T"], s["d"], s["h"], s["k"]
    flops = 18 * T * k * d * h
    ids, weights, x, w1, w2, gy = make_inputs(T, d, h, k, E, 0)
    for t in (x, weights, w1, w2):
        t.requires_grad_()
    args = (ids, weights, x, w1, w2, gy, E)
    g = torch.Generator(device="cuda").manual_seed(1)
    xd = torch.randn(T * k, d, device="cuda", generator=g).bfloat16().requires_grad_()
    w1d = (torch.randn(d, 2 * h, device="cuda", generator=g) / d**0.5).bfloat16().requires_grad_()
    w2d = (torch.randn(h, d, device="cuda", generator=g) / h**0.5).bfloat16().requires_grad_()
    gyd = torch.randn(T * k, d, device="cuda", generator=g).bfloat16()
    fns = {"ours": lambda: ours(*args), "dense": lambda: dense(xd, w1d, w2d, gyd),
           "torch_grouped_mm": lambda: torch_grouped_mm_block(*args)}
    t0 = time.time()
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    one = {m: [] for m in fns}
    many = {m: [] for m in fns}
    allocs = {m: [] for m in fns}
    for r in range(rounds):
        order = list(fns)[r % 3:] + list(fns)[: r % 3]
        for m in order:
            before = alloc_counts()
            one[m].append(sample_ms(fns[m]))
            many[m].append(sample_ms(fns[m], b2b))
            allocs[m].append(delta(alloc_counts(), before))
    row = {"shape": name, "E": E, "flops": flops, "warmup_s": warm_s,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
           "reserved_gib": torch.cuda.memory_reserved() / 2**30}
    for m in fns:
        row[m] = {"one_call_ms": median(one[m]), "b2b_ms": median(many[m]), "one_call_all": sorted(one[m]),
                  "tflops_one_call": flops / median(one[m]) / 1e9, "tflops_b2b": flops / median(many[m]) / 1e9,
                  "alloc_deltas_per_round": allocs[m]}
    # the profiled samples, interleaved as above (profiler overhead included in their event times)
    for m in ("ours", "dense"):
        row[m]["profiled_one_call"] = profiled(fns[m], 1)
        row[m]["profiled_b2b"] = profiled(fns[m], b2b)
    # the same again, after the other methods' memory is released (empty_cache): is the allocator the difference?
    torch.cuda.empty_cache()
    for m in ("ours", "dense"):
        fns[m]()
        torch.cuda.synchronize()
        row[m]["after_empty_cache_one_call_ms"] = median([sample_ms(fns[m]) for _ in range(3)])
        row[m]["after_empty_cache_b2b_ms"] = median([sample_ms(fns[m], b2b) for _ in range(3)])
    del fns
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="b:128,b:8,a:128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--back-to-back", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for case in args.cases.split(","):
        name, E = case.split(":")
        row = run_case(name, int(E), args.rounds, args.back_to_back)
        rows.append(row)
        for m in ("ours", "dense", "torch_grouped_mm"):
            r = row[m]
            print(f"{name} E={E} {m}: one {r['one_call_ms']:.2f} ms ({r['tflops_one_call']:.0f}), b2b {r['b2b_ms']:.2f} "
                  f"({r['tflops_b2b']:.0f}); allocs {r['alloc_deltas_per_round'][-1]}", flush=True)
            for key in ("profiled_one_call", "profiled_b2b"):
                if key in r:
                    q = r[key]
                    print(f"   {key}: event {q['event_ms_per_call']:.2f}, kernels {q['kernel_ms_per_call']:.2f}, span "
                          f"{q['gpu_span_ms_per_call']:.2f}, idle {q['gpu_idle_in_span_ms_per_call']:.2f}; "
                          f"stalls {q['runtime_stalls']}; gaps {q['largest_gaps_ms'][:3]}", flush=True)
            if "after_empty_cache_one_call_ms" in r:
                print(f"   after empty_cache: one {r['after_empty_cache_one_call_ms']:.2f}, b2b {r['after_empty_cache_b2b_ms']:.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
