"""Does an expert's short last tile pay as a 64-row tile in a second launch that runs beside the main one?

With random top-k routing at E=128 about half the experts end in a partial 128-row tile holding few rows
(bench/NOTES.md: 11.5% padded M-tiles at (b), ~6% at (a), the whole of (a)'s E=128 vs E=8 gap). Earlier
tries lost: a half-height tail inside the persistent loop (a branch per tile), two launches one after the
other (the tail launch alone runs badly and re-reads every expert's weights from HBM). This one splits the
SMs instead: the main launch (`tiles=1`: whole 128-row tiles, and a last tile holding more than 64 rows) runs
on sms - P persistent programs, the tail launch (`tiles=2`: last tiles of 1..64 rows, as 64-row tiles) on P
programs of a side stream at the same time, both walking the experts in order so the tails find their
expert's weights in L2. Per GEMM (fwd1 with the SwiGLU epilogue, fwd2, dgrad1), interleaved rounds: the
tuned single launch, the same main shape unsplit, the split for several P, the split run serially, grouped_mm.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_tail_streams.py OUT.json

Runs at commit c2e2504 only: the kernel's split mode (`tiles` / `other_m` / `programs` in a launch config) was taken
out after this result (bench/NOTES.md, 2026-12-06 fifth).
"""

from __future__ import annotations

import torch
from explore_common import interleaved_tflops, routed_problems, write_report

from moe_kernels.triton.grouped_gemm_kernels import _num_sms, grouped_gemm_launch
from moe_kernels.triton.tuning import tuned_configs

MAIN = {0: dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, tma=True),
        1: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, tma=True)}
TAIL = {0: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, tma=True),
        1: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, tma=True)}
TAIL_PROGRAMS = (8, 16, 24)


def gemm_cases(d, h, rows, E, g):
    """(name, a, b, out_cols, epilogue, aux, swiglu_h) for fwd1 (SwiGLU epilogue), fwd2 and dgrad1."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, d, generator=g, **bf)
    w1 = torch.randn(E, d, 2 * h, generator=g, **bf) / d ** 0.5
    act = torch.randn(rows, h, generator=g, **bf)
    w2 = torch.randn(E, h, d, generator=g, **bf) / h ** 0.5
    dpre = torch.randn(rows, 2 * h, generator=g, **bf)
    aux = torch.empty(rows, 2 * h, **bf)
    return [("fwd1", x, w1, h, 1, aux, h, 2 * rows * d * 2 * h),
            ("fwd2", act, w2, d, 0, None, 0, 2 * rows * h * d),
            ("dgrad1", dpre, w1.transpose(1, 2), d, 0, None, 0, 2 * rows * 2 * h * d)]


def main():
    side = torch.cuda.Stream()
    sms = _num_sms(torch.device("cuda"))
    results = []
    for shape, T, d, h, k, E, offs, g in routed_problems((8, 128)):
        rows = T * k
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
        rest = counts % 128
        padded_tiles = int(((counts + 127) // 128).sum())
        last_tile = torch.where(rest > 64, 128, torch.where(rest > 0, 64, 0))
        split_rows = int((counts // 128 * 128 + last_tile).sum())
        for name, a, b, n, epi, aux, sh, flops in gemm_cases(d, h, rows, E, g):
            c = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

            def run(cfg, c=c, a=a, b=b, n=n, epi=epi, aux=aux, sh=sh):
                grouped_gemm_launch(a, b, offs, out_cols=n, c=c, epilogue=epi, aux=aux, swiglu_h=sh, config=cfg)

            def tuned(c=c, a=a, b=b, n=n, epi=epi, aux=aux, sh=sh):
                grouped_gemm_launch(a, b, offs, out_cols=n, c=c, epilogue=epi, aux=aux, swiglu_h=sh)

            tuned()
            picked = dict(list(tuned_configs().values())[-1])
            main_shape = picked if picked["BLOCK_M"] == 128 else MAIN[epi]  # the tuned shape when it has 128 rows
            main_cfg, tail_cfg = dict(main_shape, tiles=1, other_m=64), dict(TAIL[epi], tiles=2, other_m=128)

            def split(p, run=run, main_cfg=main_cfg, tail_cfg=tail_cfg):
                def go():
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        run(dict(tail_cfg, programs=p))
                    run(dict(main_cfg, programs=sms - p))
                    torch.cuda.current_stream().wait_stream(side)
                return go

            def serial(run=run, main_cfg=main_cfg, tail_cfg=tail_cfg):
                run(main_cfg)
                run(tail_cfg)

            ref = c.clone()
            run(main_shape)
            same_main = bool(torch.equal(c, ref))
            errs = {}
            for p in TAIL_PROGRAMS:
                c.fill_(float("nan"))
                split(p)()
                torch.cuda.synchronize()
                errs[p] = float((c.float() - ref.float()).abs().max())
            methods = {"tuned": tuned, "main_shape": lambda run=run, cfg=main_shape: run(cfg), "serial": serial}
            methods.update({f"split_p{p}": split(p) for p in TAIL_PROGRAMS})
            for p in TAIL_PROGRAMS[:2]:  # each half of the split alone, on its share of the SMs
                methods[f"main_only_p{p}"] = lambda run=run, cfg=main_cfg, p=p: run(dict(cfg, programs=sms - p))
                methods[f"tail_only_p{p}"] = lambda run=run, cfg=tail_cfg, p=p: run(dict(cfg, programs=p))
            if epi == 0:
                methods["grouped_mm"] = lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs)
            times, tflops = interleaved_tflops(methods, flops, rounds=3)
            row = dict(shape=shape, E=E, gemm=name, main_config=main_shape, padded_m_tiles=padded_tiles, rows=rows,
                       split_mma_rows=split_rows,
                       tuned_equals_main_shape=same_main, split_max_abs_diff=errs, times_ms=times, tflops=tflops)
            results.append(row)
            print(f"{shape} E={E:3d} {name:6s} pad {padded_tiles * 128 / rows - 1:5.1%} -> {split_rows / rows - 1:5.1%}  "
                  + "  ".join(f"{m} {min(times[m]):.3f}" for m in methods) + f" ms  diff {max(errs.values()):.1e}", flush=True)
    write_report(results, "explore_tail_streams.py")


if __name__ == "__main__":
    main()
