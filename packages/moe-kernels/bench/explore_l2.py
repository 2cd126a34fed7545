"""Where the block's GEMMs at (b) spend their limits: L2 and DRAM traffic and tensor-pipe activity per
kernel, read from the hardware counters by Nsight Compute, for E=8 and E=128 against the dense GEMM
with the same FLOPs. Run under ncu (the script brackets the measured launches with cudaProfilerStart /
Stop and prints their order to stderr):

    ncu --profile-from-start off --clock-control none --csv --page raw \\
        --metrics gpu__time_duration.sum,lts__t_bytes.sum,dram__bytes.sum,\\
lts__t_sectors.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed \\
        python3 packages/moe-kernels/bench/explore_l2.py
"""

from __future__ import annotations

import argparse
import sys

import torch

from moe_kernels.triton import grouped_gemm_kernels as gg

SHAPES = {"a": dict(T=16384, d=2048, h=1024, k=8), "b": dict(T=16384, d=4096, h=4096, k=4)}


def problem(T, d, h, k, E):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
    offs = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=E), 0).to(torch.int32)
    N = T * k
    bf = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    return dict(xs=bf(N, d), w1=bf(E, d, 2 * h) / d**0.5, d_pre=bf(N, 2 * h), offs=offs, E=E)


def ops(p, gluon: bool):
    xs, w1, d_pre, offs, E = p["xs"], p["w1"], p["d_pre"], p["offs"], p["E"]
    out = {
        "fwd1 grouped_mm": lambda: torch._grouped_mm(xs, w1, offs=offs),
        "wgrad1 grouped_mm": lambda: torch._grouped_mm(xs.t(), d_pre, offs=offs),
        "wgrad1 ours": lambda: gg.grouped_wgrad_launch(xs, d_pre, offs, E),
    }
    if gluon:  # the two Gluon wgrads: the package's ping-pong kernel and the cooperative experiment
        from gluon_pingpong_wgrad import pingpong_wgrad_launch

        from moe_kernels.triton.gluon_wgrad import gluon_wgrad_launch

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        dw = torch.empty(E, xs.shape[1], d_pre.shape[1], dtype=xs.dtype, device="cuda")
        out["wgrad1 gluon_pingpong"] = lambda: pingpong_wgrad_launch(xs, d_pre, offs, dw, sms)
        for chunk, stages in ((64, 3), (32, 6)):
            out[f"wgrad1 gluon_coop r{chunk}s{stages}"] = (
                lambda chunk=chunk, stages=stages: gluon_wgrad_launch(xs, d_pre, offs, dw, sms, chunk_rows=chunk,
                                                                      stages=stages))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="b")
    ap.add_argument("--experts", default="8,128")
    ap.add_argument("--gluon", action="store_true", help="also the Gluon wgrads (triton 3.6, sm_90)")
    args = ap.parse_args()
    s = SHAPES[args.shape]
    runs = []
    for E in map(int, args.experts.split(",")):
        p = problem(s["T"], s["d"], s["h"], s["k"], E)
        for name, fn in ops(p, args.gluon).items():
            for _ in range(3):
                fn()  # tuning and warm-up outside the profiled range
            runs.append((f"{args.shape} E={E} {name}", fn))
    a = torch.randn(s["d"], s["T"] * s["k"], device="cuda").bfloat16()
    b = torch.randn(s["T"] * s["k"], 2 * s["h"], device="cuda").bfloat16()
    dense = lambda: a @ b  # noqa: E731 - the wgrad1 FLOPs as one GEMM
    dense()
    runs.append((f"{args.shape} dense wgrad1-equivalent", dense))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in runs:
        print(f"RUN {name}", file=sys.stderr, flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
