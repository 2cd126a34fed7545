"""Experiment: the cooperative grouped wgrad in Gluon whose epilogue leaves the consumers at once
(now the package's kernel, moe_kernels.triton.gluon_wgrad; this script first ran it as its own
copy, results/h200_gluon_wgrad_coop.json, commit 1130e89).

Why (bench/NOTES.md): the ping-pong wgrad (gluon_pingpong_wgrad.py) holds two independent 128x128
tiles per SM and, by the arithmetic there, needs more shared-memory bytes per clock than the SM
has; cuBLAS's cooperative 128x256 tile does not, but stalls at each tile's epilogue, which at
E=128 (~512 rows per expert) leaves its tensor pipes idle ~1/3 of the time. Here both consumer
warpgroups work on one 128x256 tile and hand their accumulators to a store warp at its end.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_gluon_wgrad_coop.py [out.json]

Since 0.6.2 it also runs the shared-output-buffer experiment (explore_gluon_wgrad_shared_out.py);
results/h200_gluon_wgrad_coop_pkg.json has the package kernel's 32x5 and 16x12 too.

Checks every variant against grouped_mm on odd counts, empty experts and NaN rows of neighbours
before timing; then (a)/(b) E=128/8 against grouped_mm, the package's tuned wgrad and the
ping-pong kernel, two interleaved rounds.
"""

from __future__ import annotations

import torch
from explore_common import interleaved_tflops, routed_problems, write_report
from gluon_pingpong_wgrad import pingpong_wgrad_launch

from explore_gluon_wgrad_shared_out import shared_out_wgrad_launch

from moe_kernels.triton.gluon_wgrad import gluon_wgrad_launch

# name -> (launch, rows per stage, stages, lead): the package kernel ("coop-", one output buffer per
# consumer) and the shared-output-buffer experiment ("shared-", explore_gluon_wgrad_shared_out.py)
VARIANTS = {"coop-r64s3": (gluon_wgrad_launch, 64, 3, None), "coop-r32s6": (gluon_wgrad_launch, 32, 6, None),
            "shared-r32s8": (shared_out_wgrad_launch, 32, 8, 0), "shared-r32s8-lead2": (shared_out_wgrad_launch, 32, 8, 2),
            "shared-r32s7": (shared_out_wgrad_launch, 32, 7, 0), "shared-r64s4": (shared_out_wgrad_launch, 64, 4, 0),
            "shared-r64s4-lead1": (shared_out_wgrad_launch, 64, 4, 1), "shared-r16s16": (shared_out_wgrad_launch, 16, 16, 0)}


def coop_wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, E: int, variant: str):
    launch, chunk, stages, lead = VARIANTS[variant]
    out = torch.empty(E, a.shape[1], b.shape[1], dtype=a.dtype, device=a.device)
    extra = {} if lead is None else {"lead_chunks": lead}
    launch(a, b, offsets, out, torch.cuda.get_device_properties(0).multi_processor_count,
           chunk_rows=chunk, stages=stages, **extra)
    return out


def _check(variant):
    g = torch.Generator(device="cuda").manual_seed(3)
    counts = torch.tensor([70, 1, 100, 50, 0, 129, 300, 64], device="cuda")
    E, K, N = len(counts), 256, 264
    rows = int(counts.sum()) + 40
    a = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    b = torch.randn(rows, N, device="cuda", generator=g).bfloat16()
    ends = torch.cumsum(counts, 0)
    offs = ends.to(torch.int32)
    a[int(ends[2]):int(ends[3])] = float("nan")  # expert 3's rows: read by expert 2's last chunk
    b[int(ends[2]):int(ends[3])] = float("nan")
    a[int(ends[-1]):] = float("nan")
    b[int(ends[-1]):] = float("nan")
    out = coop_wgrad(a, b, offs, E, variant).float()
    ref = torch._grouped_mm(a.nan_to_num(0.0).t(), b.nan_to_num(0.0), offs=offs).float()
    for e in (0, 1, 2, 4, 5, 6, 7):
        assert torch.isfinite(out[e]).all(), (variant, e)
        err = ((out[e] - ref[e]).norm() / ref[e].norm().clamp_min(1e-30)).item()
        assert err < 1e-2 or (counts[e] == 0 and torch.all(out[e] == 0)), (variant, e, err)


def main():
    from moe_kernels.triton import grouped_gemm_kernels as gg

    for v in VARIANTS:
        _check(v)
        print("check", v, "ok", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name, T, d, h, k, E, offs, g in routed_problems((128, 8)):
        n = T * k
        for op, (K, N) in {"wgrad1": (d, 2 * h), "wgrad2": (h, d)}.items():
            a = torch.randn(n, K, device="cuda", generator=g).bfloat16()
            b = torch.randn(n, N, device="cuda", generator=g).bfloat16()
            flops = 2 * n * K * N
            ref = torch._grouped_mm(a.t(), b, offs=offs).float()

            def pingpong():
                out = torch.empty(E, K, N, dtype=a.dtype, device="cuda")
                pingpong_wgrad_launch(a, b, offs, out, sms)
                return out

            methods = {"grouped_mm": lambda: torch._grouped_mm(a.t(), b, offs=offs),
                       "package_tuned": lambda: gg.grouped_wgrad_launch(a, b, offs, E),
                       "gluon_pingpong": pingpong}
            errors = {}
            for v in VARIANTS:
                fn = lambda v=v: coop_wgrad(a, b, offs, E, v)  # noqa: E731
                errors[v] = ((fn().float() - ref).norm() / ref.norm()).item()
                methods[v] = fn
            methods["package_tuned"]()
            times, tflops = interleaved_tflops(methods, flops)
            results.append(dict(shape=name, E=E, op=op, rows=n, K=K, N=N, tflops=tflops, ms=times, rel_err=errors))
            print(name, E, op, {m: round(v) for m, v in tflops.items()}, errors, flush=True)
    write_report(results, "explore_gluon_wgrad_coop.py")


if __name__ == "__main__":
    main()
