"""Experiment: the Gluon ping-pong wgrad (gluon_pingpong_wgrad.py beside this script: a loader warp and two
consumer warpgroups on alternate tiles, so one tile's epilogue overlaps the next tile's MMAs)
against the best of the package's Triton wgrad configs and torch grouped_mm, on the block's wgrad
shapes, random-routing counts, two interleaved rounds; a few ring depths / chunk heights.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_gluon_wgrad.py [out.json]
"""

from __future__ import annotations

import torch
from explore_common import interleaved_tflops, median_ms, routed_problems, write_report
from gluon_pingpong_wgrad import pingpong_wgrad_launch


def main():
    from moe_kernels.triton import grouped_gemm_kernels as gg
    from moe_kernels.triton.tuning import _unbuildable

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {"gluon-r64s4-tma": (64, 4, True), "gluon-r64s5-tma": (64, 5, True), "gluon-r64s6": (64, 6, False),
                "gluon-r128s3": (128, 3, False), "gluon-r32s12": (32, 12, False)}
    results = []
    for name, T, d, h, k, E, offs, g in routed_problems((128, 32, 8)):
        n = T * k
        for op, (K, N) in {"wgrad1": (d, 2 * h), "wgrad2": (h, d)}.items():
            a = torch.randn(n, K, device="cuda", generator=g).bfloat16()
            b = torch.randn(n, N, device="cuda", generator=g).bfloat16()
            flops = 2 * n * K * N
            ref = torch._grouped_mm(a.t(), b, offs=offs).float()
            # the best of the package's Triton configs, each forced
            triton_ms = {}
            for i, cfg in enumerate(gg._WGRAD_CONFIGS_BF16):
                try:
                    gg.grouped_wgrad_launch(a, b, offs, E, config=cfg)
                    triton_ms[i] = median_ms(lambda cfg=cfg: gg.grouped_wgrad_launch(a, b, offs, E, config=cfg))
                except Exception as exc:  # noqa: BLE001
                    if not _unbuildable(exc):
                        raise
            best_cfg = gg._WGRAD_CONFIGS_BF16[min(triton_ms, key=triton_ms.get)]
            methods = {"grouped_mm": lambda: torch._grouped_mm(a.t(), b, offs=offs),
                       "triton_best": lambda: gg.grouped_wgrad_launch(a, b, offs, E, config=best_cfg)}
            errors = {}
            for vname, (rows, stages, tma_store) in variants.items():
                def fn(rows=rows, stages=stages, tma_store=tma_store):
                    out = torch.empty(E, K, N, dtype=a.dtype, device="cuda")
                    pingpong_wgrad_launch(a, b, offs, out, sms, chunk_rows=rows, stages=stages, tma_store=tma_store)
                    return out
                try:
                    errors[vname] = ((fn().float() - ref).norm() / ref.norm()).item()
                    methods[vname] = fn
                except Exception as exc:  # noqa: BLE001
                    errors[vname] = f"{type(exc).__name__}: {str(exc)[:300]}"
            times, tflops = interleaved_tflops(methods, flops)
            row = dict(shape=name, E=E, op=op, rows=n, K=K, N=N, tflops=tflops, ms=times, rel_err=errors,
                       triton_best_config=best_cfg)
            results.append(row)
            print(name, E, op, {m: round(v) for m, v in tflops.items()},
                  {m: (round(v, 5) if isinstance(v, float) else v) for m, v in errors.items()}, flush=True)
    write_report(results, "explore_gluon_wgrad.py")


if __name__ == "__main__":
    main()
