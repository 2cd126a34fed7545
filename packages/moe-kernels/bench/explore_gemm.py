"""Per-GEMM view of the MoE block on one GPU: every block shape of our grouped GEMM kernels
(pointer loads and tensor descriptors) against torch grouped_mm, for the six GEMMs of the
block's forward+backward, plus a per-kernel profile of both block variants.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_gemm.py --out gemms.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from moe_kernels.triton import grouped_gemm_kernels as gg
from moe_kernels.triton.swiglu_kernels import swiglu_forward

SHAPES = {"a": dict(T=16384, d=2048, h=1024, k=8), "b": dict(T=16384, d=4096, h=4096, k=4)}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def problem(T, d, h, k, E):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
    flat = ids.reshape(-1)
    sort_order = torch.argsort(flat, stable=True).to(torch.int32)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    N = T * k
    bf = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    x = bf(T, d)
    xs = x[sort_order.long() // k].contiguous()
    w1, w2 = bf(E, d, 2 * h) / d**0.5, bf(E, h, d) / h**0.5
    pre = torch._grouped_mm(xs, w1, offs=offs)
    act = swiglu_forward(pre)
    dy = bf(N, d)
    return dict(x=x, xs=xs, w1=w1, w2=w2, pre=pre, act=act, dy=dy, d_pre=bf(N, 2 * h), offs=offs, sort_order=sort_order, N=N)


def ops(p, d, h, k, E):
    """name -> (flops, {config-variant: fn(config)}, grouped_mm fn)."""
    N, offs = p["N"], p["offs"]
    emp = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    act_out, pre_out, y, d_pre_out, dxs = emp(N, h), emp(N, 2 * h), emp(N, d), emp(N, 2 * h), emp(N, d)
    return {
        "fwd1 gather+swiglu": (2 * N * d * 2 * h, "swiglu", lambda c: gg.grouped_gemm_launch(
            p["x"], p["w1"], offs, out_cols=h, c=act_out, gather=p["sort_order"], top_k=k, epilogue=1, aux=pre_out, swiglu_h=h, config=c),
            lambda: torch._grouped_mm(p["xs"], p["w1"], offs=offs)),
        "fwd2": (2 * N * h * d, "gemm", lambda c: gg.grouped_gemm_launch(p["act"], p["w2"], offs, out_cols=d, c=y, config=c),
                 lambda: torch._grouped_mm(p["act"], p["w2"], offs=offs)),
        "dgrad2+swiglu'": (2 * N * d * h, "swiglu", lambda c: gg.grouped_gemm_launch(
            p["dy"], p["w2"].transpose(1, 2), offs, out_cols=h, c=d_pre_out, epilogue=2, aux=p["pre"], swiglu_h=h, config=c),
            lambda: torch._grouped_mm(p["dy"], p["w2"].transpose(1, 2), offs=offs)),
        "dgrad1": (2 * N * 2 * h * d, "gemm", lambda c: gg.grouped_gemm_launch(p["d_pre"], p["w1"].transpose(1, 2), offs, out_cols=d, c=dxs, config=c),
                   lambda: torch._grouped_mm(p["d_pre"], p["w1"].transpose(1, 2), offs=offs)),
        "wgrad2": (2 * N * h * d, "wgrad", lambda c: gg.grouped_wgrad_launch(p["act"], p["dy"], offs, E, config=c),
                   lambda: torch._grouped_mm(p["act"].t(), p["dy"], offs=offs)),
        "wgrad1 gather": (2 * N * d * 2 * h, "wgrad", lambda c: gg.grouped_wgrad_launch(
            p["x"], p["d_pre"], offs, E, gather=p["sort_order"], top_k=k, config=c),
            lambda: torch._grouped_mm(p["xs"].t(), p["d_pre"], offs=offs)),
    }


CONFIGS = {"gemm": gg._GEMM_CONFIGS_BF16, "swiglu": gg._SWIGLU_CONFIGS_BF16, "wgrad": gg._WGRAD_CONFIGS_BF16}


def dense_ceiling():
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    return 2 * 8192**3 / bench(lambda: a @ b) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="a,b")
    ap.add_argument("--experts", default="8,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    print(f"cuBLAS bf16 8192^3: {dense_ceiling():.0f} TFLOP/s")
    for name in args.shapes.split(","):
        s = SHAPES[name]
        for E in map(int, args.experts.split(",")):
            p = problem(s["T"], s["d"], s["h"], s["k"], E)
            for op, (flops, kind, fn, ref) in ops(p, s["d"], s["h"], s["k"], E).items():
                res = dict(shape=name, E=E, op=op, grouped_mm=flops / bench(ref) / 1e9, configs=[])
                for cfg in CONFIGS[kind]:
                    try:
                        fn(cfg)
                        t = bench(lambda cfg=cfg: fn(cfg))
                        res["configs"].append(dict(cfg, tflops=flops / t / 1e9))
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        res["configs"].append(dict(cfg, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                ok = [c for c in res["configs"] if "tflops" in c]
                best = {tma: max((c["tflops"] for c in ok if c["tma"] == tma), default=0) for tma in (False, True)}
                errs = [c["error"] for c in res["configs"] if "error" in c]
                print(f"{name} E={E:4d} {op:20s} grouped_mm {res['grouped_mm']:5.0f}  ours ptr {best[False]:5.0f}  ours tma {best[True]:5.0f}"
                      + (f"  errors: {errs[0]}" if errs else ""), flush=True)
                rows.append(res)
            del p
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
