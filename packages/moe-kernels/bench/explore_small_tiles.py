"""Do other tile shapes (64-row tiles: less padding; 256-row or 256x256 tiles: fewer weight re-reads) of each expert's last tile) or two persistent programs per SM
pay for the row-tiled GEMMs of the block at E=128?

With random top-k routing an expert's row count is rarely a multiple of 128, so 128-row tiles
pad each expert's last tile (11.5% extra M-tiles at (b) E=128). 64-row tiles halve that padding
but re-read each weight tile twice as often and run a 64-row wgmma; two programs per SM let one
program's epilogue overlap the other's main loop. This times, for the four row-tiled GEMMs
(fwd1 with the SwiGLU epilogue on permuted rows, fwd2, dgrad2 with SwiGLU', dgrad1), every
shipped tuning candidate and the new ones on the random-routing counts, the best of each set
also on the same rows split evenly across experts (no padding), and torch grouped_mm on both.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 packages/moe-kernels/bench/explore_small_tiles.py --out small_tiles.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.testing

from moe_kernels.triton import grouped_gemm_kernels as gg
from moe_kernels.triton.swiglu_kernels import swiglu_forward

SHAPES = {"a": dict(T=16384, d=2048, h=1024, k=8), "b": dict(T=16384, d=4096, h=4096, k=4)}

NEW_GEMM = [
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=4, tma=True),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=2, tma=True, progs=2),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, tma=True, progs=2),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, tma=True),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, tma=True, ws=1),
    dict(BLOCK_M=256, BLOCK_N=256, BLOCK_K=64, num_warps=16, num_stages=3, tma=True),
    dict(BLOCK_M=256, BLOCK_N=256, BLOCK_K=32, num_warps=16, num_stages=5, tma=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=2, tma=True),
]
NEW_SWIGLU = [
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, tma=True),
    dict(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4, tma=True),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=16, num_stages=3, tma=True),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=32, num_warps=16, num_stages=5, tma=True),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2, tma=True),
]


def ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def problem(T, d, h, k, E):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    N = T * k
    bf = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    xs = bf(N, d)
    w1, w2 = bf(E, d, 2 * h) / d**0.5, bf(E, h, d) / h**0.5
    offs = torch.cumsum(counts, 0).to(torch.int32)
    balanced = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (N // E)
    balanced[-1] = N
    pre = torch._grouped_mm(xs, w1, offs=offs)
    return dict(xs=xs, w1=w1, w2=w2, pre=pre, act=swiglu_forward(pre), dy=bf(N, d), d_pre=bf(N, 2 * h),
                offs=offs, balanced=balanced, N=N,
                padding=((counts + 127) // 128).sum().item() * 128 / N - 1)


def ops(p, d, h):
    """name -> (flops, kind, ours(config, offs), grouped_mm(offs))."""
    N = p["N"]
    emp = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    act_out, pre_out, y, d_pre_out, dxs = emp(N, h), emp(N, 2 * h), emp(N, d), emp(N, 2 * h), emp(N, d)
    w1t, w2t = p["w1"].transpose(1, 2), p["w2"].transpose(1, 2)
    return {
        "fwd1 swiglu": (2 * N * d * 2 * h, "swiglu",
                        lambda c, o: gg.grouped_gemm_launch(p["xs"], p["w1"], o, out_cols=h, c=act_out, epilogue=1,
                                                            aux=pre_out, swiglu_h=h, config=c),
                        lambda o: torch._grouped_mm(p["xs"], p["w1"], offs=o)),
        "fwd2": (2 * N * h * d, "gemm", lambda c, o: gg.grouped_gemm_launch(p["act"], p["w2"], o, out_cols=d, c=y, config=c),
                 lambda o: torch._grouped_mm(p["act"], p["w2"], offs=o)),
        "dgrad2 swiglu'": (2 * N * d * h, "swiglu",
                           lambda c, o: gg.grouped_gemm_launch(p["dy"], w2t, o, out_cols=h, c=d_pre_out, epilogue=2,
                                                               aux=p["pre"], swiglu_h=h, config=c),
                           lambda o: torch._grouped_mm(p["dy"], w2t, offs=o)),
        "dgrad1": (2 * N * 2 * h * d, "gemm", lambda c, o: gg.grouped_gemm_launch(p["d_pre"], w1t, o, out_cols=d, c=dxs, config=c),
                   lambda o: torch._grouped_mm(p["d_pre"], w1t, offs=o)),
    }


def time_configs(configs, fn, offs, flops):
    out = []
    for cfg in configs:
        cfg = {key: v for key, v in cfg.items() if key not in ("tflops", "error")}
        try:
            fn(cfg, offs)
            out.append(dict(cfg, tflops=flops / ms(lambda cfg=cfg: fn(cfg, offs)) / 1e9))
        except Exception as exc:  # noqa: BLE001 - report and go on
            out.append(dict(cfg, error=f"{type(exc).__name__}: {str(exc)[:160]}"))
    return out


def best(rows):
    ok = [r for r in rows if "tflops" in r]
    return max(ok, key=lambda r: r["tflops"]) if ok else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="b,a")
    ap.add_argument("--experts", default="128,8")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        s = SHAPES[name]
        for E in map(int, args.experts.split(",")):
            p = problem(s["T"], s["d"], s["h"], s["k"], E)
            for op, (flops, kind, ours, ref) in ops(p, s["d"], s["h"]).items():
                old = gg._SWIGLU_CONFIGS_BF16 if kind == "swiglu" else gg._GEMM_CONFIGS_BF16
                new = NEW_SWIGLU if kind == "swiglu" else NEW_GEMM
                old_rows = time_configs(old, ours, p["offs"], flops)
                new_rows = time_configs(new, ours, p["offs"], flops)
                bo, bn = best(old_rows), best(new_rows)
                row = dict(shape=name, E=E, op=op, m_tile_padding_128=p["padding"],
                           grouped_mm=flops / ms(lambda: ref(p["offs"])) / 1e9,
                           grouped_mm_balanced=flops / ms(lambda: ref(p["balanced"])) / 1e9,
                           shipped=old_rows, new=new_rows,
                           shipped_best_balanced=time_configs([bo], ours, p["balanced"], flops)[0] if bo else None,
                           new_best_balanced=time_configs([bn], ours, p["balanced"], flops)[0] if bn else None)
                rows.append(row)
                fmt = lambda r: "-" if r is None else f"{r.get('tflops', 0):5.0f}"  # noqa: E731
                shape_of = lambda r: "-" if r is None else f"{r['BLOCK_M']}x{r['BLOCK_N']}x{r['BLOCK_K']}w{r['num_warps']}s{r['num_stages']}p{r.get('progs', 1)}ws{r.get('ws', 0)}"  # noqa: E731
                print(f"{name} E={E:4d} {op:15s} gmm {row['grouped_mm']:5.0f} (bal {row['grouped_mm_balanced']:5.0f})"
                      f"  shipped {fmt(bo)} {shape_of(bo)} (bal {fmt(row['shipped_best_balanced'])})"
                      f"  new {fmt(bn)} {shape_of(bn)} (bal {fmt(row['new_best_balanced'])})", flush=True)
                errs = [r["error"] for r in old_rows + new_rows if "error" in r]
                if errs:
                    print("   errors:", len(errs), errs[0][:120])
            del p
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           commit=args.commit, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
