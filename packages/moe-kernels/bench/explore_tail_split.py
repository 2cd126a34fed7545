"""Does splitting each expert's rows into whole 128-row tiles and a tail pay, with cuBLAS alone?

With random top-k routing at E=128 an expert has ~512 rows but rarely a multiple of 128, so a
128-row tile grid pads each expert's last tile (11.9% more M-tiles than rows at (b) E=128). If
the permutation laid rows out as [every expert's whole tiles][every expert's tail rows], each
row-tiled GEMM could run as two grouped GEMMs: one with no padding at all, one over the short
tails (where the library may pick a shorter tile). This times, per GEMM of the block, torch
grouped_mm on the usual layout ("single"), the two calls of the split layout ("split"), and
the same rows split evenly across experts ("balanced", no padding: the ceiling). wgrad over the
split layout needs the two partial weight gradients added ("split" includes that add).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 packages/moe-kernels/bench/explore_tail_split.py --out tail.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

SHAPES = {"a": dict(T=16384, d=2048, h=1024, k=8), "b": dict(T=16384, d=4096, h=4096, k=4)}


def routed_counts(T, k, E, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
    return torch.bincount(ids.reshape(-1), minlength=E)


def offsets(counts):
    return torch.cumsum(counts, 0).to(torch.int32)


def split_counts(counts, tile=128):
    full = counts // tile * tile
    return full, counts - full


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def timed_row(fns, rounds, flops, row):
    """row + {method: ms, TFLOP/s, samples} with the methods timed in interleaved rounds; printed."""
    times = {m: [] for m in fns}
    for _ in range(rounds):
        for m, fn in fns.items():
            times[m].append(median_ms(fn))
    for m, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        row[m] = dict(ms=ms, tflops=flops / ms / 1e9, times_ms=ts)
    print(f"{row['shape']} E={row['E']} {row['gemm']:>7}: " + "  ".join(f"{m} {row[m]['tflops']:5.0f}" for m in fns)
          + f" TFLOP/s   (split rel err {row['rel_err_split']:.1e})", flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="b,a")
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--commit", default=None)
    args = p.parse_args()
    rows = []
    for name in args.shapes.split(","):
        s = SHAPES[name]
        T, d, h, k, E = s["T"], s["d"], s["h"], s["k"], args.E
        n = T * k
        counts = routed_counts(T, k, E)
        full, tail = split_counts(counts)
        n_full = int(full.sum())
        balanced = torch.full((E,), n // E, device="cuda", dtype=torch.long)
        g = torch.Generator(device="cuda").manual_seed(1)
        w1 = (torch.randn(E, d, 2 * h, device="cuda", generator=g) / d**0.5).bfloat16()
        w2 = (torch.randn(E, h, d, device="cuda", generator=g) / h**0.5).bfloat16()
        # row i of the split layout is row perm[i] of the usual (expert-contiguous) layout
        starts = torch.cumsum(counts, 0) - counts
        full_parts, tail_parts = [], []
        for e in range(E):
            st, f, c = int(starts[e]), int(full[e]), int(counts[e])
            full_parts.append(torch.arange(st, st + f, device="cuda"))
            tail_parts.append(torch.arange(st + f, st + c, device="cuda"))
        perm = torch.cat(full_parts + tail_parts)
        gemms = {  # name: (rows operand width, weights)
            "fwd1": (d, w1), "fwd2": (h, w2), "dgrad2": (d, w2.transpose(1, 2)), "dgrad1": (2 * h, w1.transpose(1, 2)),
        }
        for gname, (width, w) in gemms.items():
            a = torch.randn(n, width, device="cuda", generator=g).bfloat16()
            o_single, o_full, o_tail, o_bal = offsets(counts), offsets(full), offsets(tail), offsets(balanced)
            fns = {
                "single": lambda a=a, w=w, o=o_single: torch._grouped_mm(a, w, offs=o),
                "split": lambda a=a, w=w, of=o_full, ot=o_tail: (torch._grouped_mm(a[:n_full], w, offs=of),
                                                                torch._grouped_mm(a[n_full:], w, offs=ot)),
                "balanced": lambda a=a, w=w, o=o_bal: torch._grouped_mm(a, w, offs=o),
            }
            # the split layout computes the same rows: check against the usual layout
            ref = fns["single"]()
            a_split = a[perm]
            got = torch.cat([torch._grouped_mm(a_split[:n_full], w, offs=o_full), torch._grouped_mm(a_split[n_full:], w, offs=o_tail)])
            err = float((got.float() - ref[perm].float()).norm() / ref.float().norm())
            rows.append(timed_row(fns, args.rounds, 2 * n * width * w.shape[2], dict(
                shape=name, E=E, gemm=gname, rows=n, padded_m_tiles=int(((counts + 127) // 128).sum()),
                m_tiles_needed=-(-n // 128), rel_err_split=err)))
        # wgrad over rows: the split layout adds the two partial gradients
        for gname, (left, right) in {"wgrad2": (h, d), "wgrad1": (d, 2 * h)}.items():
            a = torch.randn(n, left, device="cuda", generator=g).bfloat16()
            b = torch.randn(n, right, device="cuda", generator=g).bfloat16()
            o_single, o_full, o_tail, o_bal = offsets(counts), offsets(full), offsets(tail), offsets(balanced)
            fns = {
                "single": lambda: torch._grouped_mm(a.t(), b, offs=o_single),
                "split": lambda: torch._grouped_mm(a[:n_full].t(), b[:n_full], offs=o_full).add_(
                    torch._grouped_mm(a[n_full:].t(), b[n_full:], offs=o_tail)),
                "balanced": lambda: torch._grouped_mm(a.t(), b, offs=o_bal),
            }
            want = fns["single"]()
            a_s, b_s = a[perm], b[perm]
            got = torch._grouped_mm(a_s[:n_full].t(), b_s[:n_full], offs=o_full) + torch._grouped_mm(
                a_s[n_full:].t(), b_s[n_full:], offs=o_tail)
            err = float((got.float() - want.float()).norm() / want.float().norm())
            rows.append(timed_row(fns, args.rounds, 2 * n * left * right,
                                  dict(shape=name, E=E, gemm=gname, rows=n, rel_err_split=err)))
        del w1, w2
        torch.cuda.empty_cache()
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, commit=args.commit,
                    command="python3 packages/moe-kernels/bench/explore_tail_split.py " + " ".join(
                        f"--{k}={v}" for k, v in vars(args).items() if v is not None and k != "out"))
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
