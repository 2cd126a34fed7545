"""Could the block's first GEMM (x @ W1 with SwiGLU) run on our kernel with TMA loads of
pre-permuted rows, instead of torch grouped_mm (which every tuned plan picks today)?

Times, on random-routing offsets: grouped_mm + our SwiGLU pass (today's pick); our kernel with
the SwiGLU epilogue reading the permuted rows through tensor descriptors (no gather), for each
SwiGLU block shape; the same kernel gathering rows from x (today's "fused"); our plain GEMM +
SwiGLU pass. Every output is checked against grouped_mm's.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_fwd1.py --out fwd1.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.testing

from moe_kernels.triton import grouped_gemm_kernels as gg
from moe_kernels.triton.permute_kernels import scatter_rows
from moe_kernels.triton.swiglu_kernels import swiglu_forward
from moe_kernels.route_map import build_route_map

SHAPES = {"a": dict(T=16384, d=2048, h=1024, k=8), "b": dict(T=16384, d=4096, h=4096, k=4)}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="b128,b8,a128,a8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        s, E = SHAPES[case[0]], int(case[1:])
        T, d, h, k = s["T"], s["d"], s["h"], s["k"]
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
        rm = build_route_map(ids, E)
        x = torch.randn(T, d, device="cuda", generator=g).bfloat16()
        w1 = (torch.randn(E, d, 2 * h, device="cuda", generator=g) / d**0.5).bfloat16()
        xs = scatter_rows(x, rm.dest_row, k)
        n = xs.shape[0]
        flops = 2 * n * d * 2 * h
        ref = swiglu_forward(torch._grouped_mm(xs, w1, offs=rm.offsets))
        fns = {"grouped_mm+swiglu": lambda: swiglu_forward(torch._grouped_mm(xs, w1, offs=rm.offsets))}
        for i, cfg in enumerate(gg._SWIGLU_CONFIGS_BF16):
            def ep(cfg=cfg, gather=False):
                act = torch.empty(n, h, dtype=x.dtype, device=x.device)
                pre = torch.empty(n, 2 * h, dtype=x.dtype, device=x.device)
                gg.grouped_gemm_launch(x if gather else xs, w1, rm.offsets, out_cols=h, c=act,
                                       gather=rm.sort_order if gather else None, top_k=k, epilogue=1, aux=pre,
                                       swiglu_h=h, config=cfg)
                return act
            fns[f"epilogue_sorted[{i}]"] = ep
            fns[f"epilogue_gather[{i}]"] = lambda cfg=cfg: ep(cfg, True)
        for i, cfg in enumerate(gg._GEMM_CONFIGS_BF16):
            def plain(cfg=cfg):
                c = torch.empty(n, 2 * h, dtype=x.dtype, device=x.device)
                return swiglu_forward(gg.grouped_gemm_launch(xs, w1, rm.offsets, out_cols=2 * h, c=c, config=cfg))
            fns[f"plain+swiglu[{i}]"] = plain
        errs, times = {}, {m: [] for m in fns}
        for m, fn in list(fns.items()):
            try:
                errs[m] = rel_err(fn(), ref)
            except Exception as exc:  # a candidate the compiler rejects
                print(f"{case} {m}: {type(exc).__name__}: {str(exc)[:120]}")
                fns.pop(m), times.pop(m)
        for _ in range(args.rounds):
            for m, fn in fns.items():
                times[m].append(bench(fn))
        row = dict(case=case, E=E, rows=n, flops=flops)
        for m in fns:
            ms = sorted(times[m])[len(times[m]) // 2]
            row[m] = dict(ms=ms, tflops=flops / ms / 1e9, rel_err=errs[m])
        rows.append(row)
        best = max(fns, key=lambda m: row[m]["tflops"])
        print(f"{case}: " + ", ".join(f"{m} {row[m]['tflops']:.0f}" for m in fns) + f"  | best {best}", flush=True)
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               swiglu_configs=gg._SWIGLU_CONFIGS_BF16, gemm_configs=gg._GEMM_CONFIGS_BF16, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
