"""Do 64x512 tiles (two warpgroups side by side on 64 rows, each a full m64n256 wgmma) pay for the
row-tiled GEMMs of the block at E=128?

With random top-k routing an expert's row count is rarely a multiple of the tile height, so each
expert's last M-tile is padded: 11.5% extra rows at (b) E=128 with 128-row tiles, about half that
with 64-row tiles. explore_small_tiles.py tried 64-row tiles with one warpgroup (64x256, 4 warps):
they lost 10-40%, because one warpgroup per SM cannot keep the tensor pipe busy. A 64x512 tile keeps
two warpgroups and the m64n256k16 instruction of the shipped 128x256 tile (the same shared-memory
operand bytes per FLOP); what it costs is 1.5x the bytes each K-step brings into shared memory
(8 KB of A and 64 KB of B instead of 16 + 32 KB). The SwiGLU kernels (two accumulators) get the
analogous 64x256 tile on 8 warps.

For fwd1 (SwiGLU epilogue), fwd2, dgrad2 (SwiGLU') and dgrad1, per shape: every shipped candidate
and the wide ones are timed alone (do_bench medians) to pick each set's best, then grouped_mm, the
shipped best and the wide best are timed in interleaved rounds on the random-routing counts and on
the same rows split evenly (no padding). The wide best is first checked against the shipped best
on the same inputs and, for the plain GEMMs, against grouped_mm on counts with empty experts.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 packages/moe-kernels/bench/explore_wide_tiles.py OUT.json
"""

from __future__ import annotations

import sys

import torch
from explore_common import interleaved_tflops, write_report
from explore_small_tiles import SHAPES, best, ops, problem, time_configs

from moe_kernels.triton import grouped_gemm_kernels as gg

WIDE_GEMM = [
    dict(BLOCK_M=64, BLOCK_N=512, BLOCK_K=64, num_warps=8, num_stages=3, tma=True),
    dict(BLOCK_M=64, BLOCK_N=512, BLOCK_K=64, num_warps=8, num_stages=3, tma=True, ws=1),
    dict(BLOCK_M=64, BLOCK_N=512, BLOCK_K=32, num_warps=8, num_stages=6, tma=True),
    dict(BLOCK_M=64, BLOCK_N=512, BLOCK_K=64, num_warps=8, num_stages=2, tma=True),
]
WIDE_SWIGLU = [
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, tma=True),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=32, num_warps=8, num_stages=6, tma=True),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=2, tma=True),
]
CASES = [("b", 128), ("b", 8), ("a", 128)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def edge_offsets(E: int, rows: int) -> torch.Tensor:
    """Counts with empty experts (every fifth) and odd sizes, summing to `rows`."""
    g = torch.Generator().manual_seed(1)
    w = torch.rand(E, generator=g)
    w[::5] = 0
    counts = (w / w.sum() * rows).floor().long()
    counts[1] += rows - counts.sum()
    return torch.cumsum(counts, 0).to(torch.int32).cuda()


def check_plain(fn, ref, cfg, E, rows) -> float:
    offs = edge_offsets(E, rows)
    return rel_err(fn(cfg, offs).clone(), ref(offs))


def main():
    results = []
    for name, E in CASES:
        s = SHAPES[name]
        p = problem(s["T"], s["d"], s["h"], s["k"], E)
        for op, (flops, kind, ours, ref) in ops(p, s["d"], s["h"]).items():
            shipped = gg._SWIGLU_CONFIGS_BF16 if kind == "swiglu" else gg._GEMM_CONFIGS_BF16
            wide = WIDE_SWIGLU if kind == "swiglu" else WIDE_GEMM
            shipped_rows, wide_rows = time_configs(shipped, ours, p["offs"], flops), time_configs(wide, ours, p["offs"], flops)
            bs, bw = best(shipped_rows), best(wide_rows)
            row = dict(shape=name, E=E, op=op, m_tile_padding_128=p["padding"], shipped=shipped_rows, wide=wide_rows)
            if bs is None or bw is None:
                row["skipped"] = "no config of one set ran"
                results.append(row)
                print(name, E, op, "skipped", [r.get("error") for r in wide_rows][:1], flush=True)
                continue
            cs = {k: v for k, v in bs.items() if k != "tflops"}
            cw = {k: v for k, v in bw.items() if k != "tflops"}
            out_s = ours(cs, p["offs"]).clone()
            out_w = ours(cw, p["offs"]).clone()
            row["rel_err_wide_vs_shipped"] = rel_err(out_w, out_s)
            if kind == "gemm":
                row["rel_err_wide_vs_grouped_mm_edge_counts"] = check_plain(ours, ref, cw, E, p["N"])
            for label, offs in (("random", p["offs"]), ("balanced", p["balanced"])):
                times, tf = interleaved_tflops({"grouped_mm": lambda o=offs: ref(o),
                                                "shipped": lambda o=offs: ours(cs, o),
                                                "wide": lambda o=offs: ours(cw, o)}, flops)
                row[label] = dict(ms=times, tflops=tf)
            row["shipped_best"], row["wide_best"] = cs, cw
            results.append(row)
            r, b = row["random"]["tflops"], row["balanced"]["tflops"]
            print(f"{name} E={E:3d} {op:15s} random gmm {r['grouped_mm']:5.0f} shipped {r['shipped']:5.0f} wide {r['wide']:5.0f}"
                  f" | balanced {b['grouped_mm']:5.0f} {b['shipped']:5.0f} {b['wide']:5.0f}"
                  f" | wide {cw['BLOCK_M']}x{cw['BLOCK_N']}x{cw['BLOCK_K']}s{cw['num_stages']}ws{cw.get('ws', 0)}"
                  f" err {row['rel_err_wide_vs_shipped']:.1e} {row.get('rel_err_wide_vs_grouped_mm_edge_counts', 0):.1e}",
                  flush=True)
        del p
        torch.cuda.empty_cache()
    write_report(results, "explore_wide_tiles.py")


if __name__ == "__main__":
    sys.exit(main())
