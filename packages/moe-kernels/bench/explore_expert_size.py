"""How much of the slowdown at many small experts belongs to the per-expert shape itself?

For the block's six GEMMs at shapes (a) and (b), times cuBLAS on perfectly balanced experts
(torch.bmm over [E, N/E, ...] and torch grouped_mm with equal offsets) for E = 1 (dense), 8, 32,
128, and our Triton forward kernel with 256-row tiles at E=128 (an experiment: two 128-row
warpgroups share each weight tile). The sum over the six GEMMs gives a GEMM-only block
TFLOP/s per E: the ceiling cuBLAS itself reaches on that expert size, with no routing at all.
Also prints the bytes of weights read and weight gradients written per block (they grow with E;
the dense chain touches one expert's worth).

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_expert_size.py --out size.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.testing

from moe_kernels.triton import grouped_gemm_kernels as gg

SHAPES = {"a": dict(T=16384, d=2048, h=1024, k=8), "b": dict(T=16384, d=4096, h=4096, k=4)}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def gemms(N, d, h, E):
    """name -> (flops, bmm fn, grouped_mm fn) with E equal experts of N/E rows each."""
    n = N // E
    r = lambda *s: torch.randn(*s, device="cuda").bfloat16()  # noqa: E731
    x, act, dy, d_pre = r(E, n, d), r(E, n, h), r(E, n, d), r(E, n, 2 * h)
    w1, w2 = r(E, d, 2 * h), r(E, h, d)
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * n
    flat = lambda t: t.reshape(N, t.shape[-1])  # noqa: E731
    # (a, b) for a @ b, bmm form; the grouped form uses flat rows (wgrad: a^T over rows)
    pairs = {
        "fwd1": (x, w1), "fwd2": (act, w2), "dgrad2": (dy, w2.transpose(1, 2)), "dgrad1": (d_pre, w1.transpose(1, 2)),
        "wgrad2": (act.transpose(1, 2), dy), "wgrad1": (x.transpose(1, 2), d_pre),
    }
    out = {}
    for name, (a, b) in pairs.items():
        flops = 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        if name.startswith("wgrad"):
            ga, gb = flat(a.transpose(1, 2)).t(), flat(b)
        else:
            ga, gb = flat(a), b
        out[name] = (flops, lambda a=a, b=b: torch.bmm(a, b), lambda ga=ga, gb=gb: torch._grouped_mm(ga, gb, offs=offs))
    return out, dict(act=flat(act), w2=w2, d_pre=flat(d_pre), w1=w1, offs=offs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name, s in SHAPES.items():
        N, d, h = s["T"] * s["k"], s["d"], s["h"]
        for E in (1, 8, 32, 128):
            ops, t = gemms(N, d, h, E)
            row = dict(shape=name, E=E, rows_per_expert=N // E, weight_bytes_per_block=3 * E * d * 3 * h * 2, gemms={})
            tb = tg = fl = 0.0
            for op, (flops, f_bmm, f_gmm) in ops.items():
                ms_b, ms_g = bench(f_bmm), bench(f_gmm)
                row["gemms"][op] = dict(bmm=flops / ms_b / 1e9, grouped_mm=flops / ms_g / 1e9)
                tb, tg, fl = tb + ms_b, tg + ms_g, fl + flops
            row["chain_bmm"], row["chain_grouped_mm"] = fl / tb / 1e9, fl / tg / 1e9
            if E == 128:
                # our forward kernel, 128x256 (the tuned shape) against 256x128 tiles, fwd2 and dgrad1
                y = torch.empty(N, d, device="cuda", dtype=torch.bfloat16)
                trials = {}
                for op, a, b in (("fwd2", t["act"], t["w2"]), ("dgrad1", t["d_pre"], t["w1"].transpose(1, 2))):
                    flops = 2 * N * a.shape[1] * d
                    for bm, bn, stages in ((128, 256, 3), (128, 256, 4), (256, 128, 3), (256, 128, 4)):
                        for tma in (False, True):
                            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_warps=8, num_stages=stages, tma=tma)
                            key = f"{op} {bm}x{bn} s{stages} tma={tma}"
                            try:
                                fn = lambda a=a, b=b, cfg=cfg: gg.grouped_gemm_launch(a, b, t["offs"], out_cols=d, c=y, config=cfg)  # noqa: E731
                                fn()
                                trials[key] = flops / bench(fn) / 1e9
                            except Exception as exc:  # noqa: BLE001 - record and go on
                                trials[key] = f"{type(exc).__name__}: {str(exc)[:160]}"
                row["ours_fwd_tiles"] = trials
            rows.append(row)
            g = " ".join(f"{op}={v['bmm']:.0f}/{v['grouped_mm']:.0f}" for op, v in row["gemms"].items())
            print(f"{name} E={E:4d} chain bmm {row['chain_bmm']:5.0f} grouped_mm {row['chain_grouped_mm']:5.0f} | {g}", flush=True)
            if "ours_fwd_tiles" in row:
                print("   ", {k: (round(v) if isinstance(v, float) else v) for k, v in row["ours_fwd_tiles"].items()}, flush=True)
            del ops, t
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
