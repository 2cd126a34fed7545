"""Backward GEMM pairs on two streams: does running dgrad and wgrad of the same layer side by side recover the
tail of each persistent launch (the last wave, where the SMs whose tiles ran out idle until the slowest finishes)?

dgrad1 (d_pre @ W1^T) and wgrad1 (xs^T d_pre) read the same d_pre and are independent; so are dgrad2 (dy @ W2^T)
and wgrad2 (act^T dy). Each pair is timed one after the other on one stream ("seq") and with the wgrad on a side
stream forked and joined by events ("conc"), for our Triton kernels and torch grouped_mm, random top-k routing,
interleaved rounds (explore_common). Outputs of both orders are compared bit for bit before any timing.
Then the whole block forward+backward (swiglu_ffn_routed) with the plan results/h200_moe_block.json recorded for
that shape, wgrad_stream "same" against "side".

The block rows need `BlockPlan.wgrad_stream`, which moe-kernels had only at commit 7ad25cb: the measurement
(results/h100_concurrent_backward_e128.json, bench/NOTES.md) found no gain, and the field was taken out again.
The pair rows run on any commit.

GPU:  source tools/gpu_env.sh; python3 packages/moe-kernels/bench/explore_concurrent_backward.py OUT.json [E ...]
"""

from __future__ import annotations

import torch

import json
import sys
from dataclasses import replace
from pathlib import Path

from explore_common import interleaved_tflops, routed_problems, write_report
from moe_kernels import build_route_map
from moe_kernels.triton.ffn_kernels import BlockPlan, gemm, swiglu_ffn_routed, wgrad

OFFICIAL = Path(__file__).parent / "results" / "h200_moe_block.json"


def pair(dgrad_args, wgrad_args, impl: str, side: torch.cuda.Stream | None):  # noqa: ANN001, ANN201
    """dgrad then wgrad; with `side`, the wgrad runs on it, forked after and joined before the current stream's
    next work."""
    a, b, offs = dgrad_args
    wa, wb, woffs, E = wgrad_args
    if side is None:
        return gemm(a, b, offs, impl), wgrad(wa, wb, woffs, E, impl, b.dtype)
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        gw = wgrad(wa, wb, woffs, E, impl, b.dtype)
    gx = gemm(a, b, offs, impl)
    main.wait_stream(side)
    gw.record_stream(main)
    return gx, gw


def main() -> None:
    side = torch.cuda.Stream()
    results = []
    experts = tuple(int(e) for e in sys.argv[2:]) or (8, 128)  # OUT.json [E ...]
    for name, T, d, h, k, E, offs, g in routed_problems(experts):
        n = T * k
        bf = dict(device="cuda", dtype=torch.bfloat16)
        xs, d_pre = torch.randn(n, d, **bf, generator=g), torch.randn(n, 2 * h, **bf, generator=g)
        act, dy = torch.randn(n, h, **bf, generator=g), torch.randn(n, d, **bf, generator=g)
        w1 = torch.randn(E, d, 2 * h, **bf, generator=g) / d**0.5
        w2 = torch.randn(E, h, d, **bf, generator=g) / h**0.5
        pairs = {
            "1": ((d_pre, w1.transpose(1, 2), offs), (xs, d_pre, offs, E), 2 * 2 * n * d * 2 * h),
            "2": ((dy, w2.transpose(1, 2), offs), (act, dy, offs, E), 2 * 2 * n * d * h),
        }
        for which, (dg, wg, flops) in pairs.items():
            for impl in ("triton", "grouped_mm"):
                seq = pair(dg, wg, impl, None)
                conc = pair(dg, wg, impl, side)
                torch.cuda.synchronize()
                same = all(torch.equal(s, c) for s, c in zip(seq, conc))
                methods = {"seq": lambda: pair(dg, wg, impl, None), "conc": lambda: pair(dg, wg, impl, side)}
                times, tflops = interleaved_tflops(methods, flops, rounds=3)
                row = dict(shape=name, E=E, pair=which, impl=impl, bit_identical=same, ms=times,
                           tflops={m: round(v, 1) for m, v in tflops.items()})
                print(row, flush=True)
                results.append(row)
        del xs, d_pre, act, dy, w1, w2, pairs, seq, conc, methods  # room for the block's tensors (H100)
        torch.cuda.empty_cache()
        results.append(block_row(name, T, d, h, k, E, g))
        print(results[-1], flush=True)
        write_report(results, "explore_concurrent_backward.py")  # after every shape: a later failure keeps these


def block_row(name: str, T: int, d: int, h: int, k: int, E: int, g: torch.Generator) -> dict:
    """The block forward+backward with the official table's plan for this shape, one stream against two."""
    rows = [r for r in json.loads(OFFICIAL.read_text())["rows"] if r["shape"] == name and r["E"] == E]
    same = BlockPlan(**rows[0]["ours_plan"]) if rows else BlockPlan()
    side = replace(same, wgrad_stream="side")
    ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
    rm = build_route_map(ids, E)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, d, **bf, generator=g).requires_grad_()
    w = torch.rand(T, k, device="cuda", generator=g).requires_grad_()
    w1 = (torch.randn(E, d, 2 * h, **bf, generator=g) / d**0.5).requires_grad_()
    w2 = (torch.randn(E, h, d, **bf, generator=g) / h**0.5).requires_grad_()
    grad = torch.randn(T, d, **bf, generator=g)

    def step(plan):  # noqa: ANN001, ANN202
        out = swiglu_ffn_routed(x, w, w1, w2, rm.offsets, rm.sort_order, rm.dest_row, plan)
        return torch.autograd.grad(out, (x, w, w1, w2), grad)

    a, b = step(same), step(side)
    torch.cuda.synchronize()
    same_bits = all(torch.equal(p, q) for p, q in zip(a, b))
    times, tflops = interleaved_tflops({"same": lambda: step(same), "side": lambda: step(side)},
                                       18 * T * k * d * h, rounds=3)
    return dict(shape=name, E=E, pair="block", plan=str(same), bit_identical=same_bits, ms=times,
                tflops={m: round(v, 1) for m, v in tflops.items()})


if __name__ == "__main__":
    main()
