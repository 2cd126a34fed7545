"""Does Triton's warp specialisation help the package's grouped GEMM kernels on the H200?

For the GEMMs that lose most at many small experts ((b) E=128: 512 rows per expert), times the
package's forward kernel and its wgrad kernel with `ws` = 0 (as shipped), 1 (warp-specialised
persistent tile loop) and 2 (warp-specialised K / row loop), against torch's grouped_mm on the
same random-routing offsets, and checks every variant's output against grouped_mm.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_warp_spec.py --out ws.json
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


def routed_offsets(T, k, E, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=E)
    return torch.cumsum(counts, 0).to(torch.int32)


def variants(kind):
    if kind == "gemm":
        shapes = [(0, 256, 8, 3), (0, 256, 8, 4), (1, 256, 8, 3), (1, 256, 4, 3), (1, 128, 4, 4),
                  (2, 256, 8, 3), (2, 256, 4, 3), (2, 128, 4, 4)]
        return [dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, num_warps=w, num_stages=st, tma=True, ws=ws) for ws, bn, w, st in shapes]
    # wgrad is one program per output tile: only its row loop can be warp-specialised
    shapes = [(0, 256, 8, 3), (0, 128, 8, 4), (2, 256, 8, 3), (2, 256, 4, 3), (2, 128, 4, 4), (2, 128, 8, 4)]
    return [dict(BLOCK_K=128, BLOCK_N=bn, BLOCK_R=64, num_warps=w, num_stages=st, tma=True, ws=ws) for ws, bn, w, st in shapes]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="b128,b8,a128")
    args = ap.parse_args()
    rows = []
    r = lambda *s: torch.randn(*s, device="cuda").bfloat16()  # noqa: E731
    for case in args.cases.split(","):
        s, E = SHAPES[case[0]], int(case[1:])
        N, d, h = s["T"] * s["k"], s["d"], s["h"]
        offs = routed_offsets(s["T"], s["k"], E, seed=0)
        act, dy, d_pre = r(N, h), r(N, d), r(N, 2 * h)
        w1, w2 = r(E, d, 2 * h), r(E, h, d)
        ops = {
            "fwd2": ("gemm", act, w2, d, lambda: torch._grouped_mm(act, w2, offs=offs)),
            "dgrad1": ("gemm", d_pre, w1.transpose(1, 2), d, lambda: torch._grouped_mm(d_pre, w1.transpose(1, 2), offs=offs)),
            "wgrad2": ("wgrad", act, dy, None, lambda: torch._grouped_mm(act.t(), dy, offs=offs)),
        }
        for op, (kind, a, b, out_cols, ref_fn) in ops.items():
            flops = 2 * N * a.shape[1] * (out_cols if kind == "gemm" else b.shape[1])
            ref = ref_fn()
            row = dict(case=case, op=op, grouped_mm=flops / bench(ref_fn) / 1e9, variants=[])
            c = torch.empty(N, out_cols, device="cuda", dtype=torch.bfloat16) if kind == "gemm" else None
            for cfg in variants(kind):
                rec = dict(cfg)
                try:
                    if kind == "gemm":
                        fn = lambda cfg=cfg: gg.grouped_gemm_launch(a, b, offs, out_cols=out_cols, c=c, config=cfg)  # noqa: E731
                    else:
                        fn = lambda cfg=cfg: gg.grouped_wgrad_launch(a, b, offs, E, config=cfg)  # noqa: E731
                    got = fn()
                    torch.cuda.synchronize()
                    rec["rel_err"] = rel_err(got, ref)
                    rec["tflops"] = flops / bench(fn) / 1e9
                except Exception as exc:  # noqa: BLE001 - record and go on
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                row["variants"].append(rec)
            rows.append(row)
            best = {}
            for v in row["variants"]:
                if "tflops" in v and v["rel_err"] < 2e-2:
                    best[v["ws"]] = max(best.get(v["ws"], 0), v["tflops"])
            errs = sorted({v["error"][:90] for v in row["variants"] if "error" in v})
            bad = [v for v in row["variants"] if v.get("rel_err", 0) >= 2e-2]
            print(f"{case} {op:7s} grouped_mm {row['grouped_mm']:5.0f} | best by ws {({k: round(x) for k, x in best.items()})}"
                  f" | wrong {len(bad)} | errors {errs}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1)
        del act, dy, d_pre, w1, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
