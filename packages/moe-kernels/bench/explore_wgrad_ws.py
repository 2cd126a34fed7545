"""Experiment: a persistent wgrad whose tile loop is warp-specialised (a producer warp streams the
next tile's TMA loads while the consumer warpgroups finish this tile: reduce, convert, store),
with host tensor descriptors for whole row chunks, a masked pointer-load step for an expert's
partial last chunk, and an optional TMA store of the output tile (a 3-D [E, K, N] descriptor,
so a tile never spills into the next expert). Compared with the package's tuned wgrad and torch
grouped_mm on the block's wgrad shapes, random-routing and balanced counts, two interleaved rounds.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_wgrad_ws.py [out.json]
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _wgrad_ws_kernel(
    a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, offsets_ptr, E, K, N, stride_am, stride_bm,
    WS: tl.constexpr, FLATTEN: tl.constexpr, STORE_TMA: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    per_e = num_k * num_n
    total = E * per_e
    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN, warp_specialize=WS):
        e = tile // per_e
        rest = tile % per_e
        k0 = (rest // num_n) * BLOCK_K
        n0 = (rest % num_n) * BLOCK_N
        end = tl.load(offsets_ptr + e)
        start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
        full_end = start + (end - start) // BLOCK_R * BLOCK_R
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for r0 in tl.range(start, full_end, BLOCK_R):
            a = a_desc.load([r0, k0])
            b = b_desc.load([r0, n0])
            acc = tl.dot(tl.trans(a), b, acc)
        rk = k0 + tl.arange(0, BLOCK_K)
        rn = n0 + tl.arange(0, BLOCK_N)
        if full_end < end:
            rr = full_end + tl.arange(0, BLOCK_R)
            rmask = rr < end
            a = tl.load(a_ptr + rr.to(tl.int64)[:, None] * stride_am + rk[None, :], mask=rmask[:, None] & (rk < K)[None, :], other=0.0)
            b = tl.load(b_ptr + rr.to(tl.int64)[:, None] * stride_bm + rn[None, :], mask=rmask[:, None] & (rn < N)[None, :], other=0.0)
            acc = tl.dot(tl.trans(a), b, acc)
        out = acc.to(c_ptr.dtype.element_ty)
        if STORE_TMA:
            c_desc.store([e, k0, n0], out.reshape(1, BLOCK_K, BLOCK_N))
        else:
            c_ptrs = c_ptr + e.to(tl.int64) * K * N + rk[:, None] * N + rn[None, :]
            tl.store(c_ptrs, out, mask=(rk < K)[:, None] & (rn < N)[None, :])


def wgrad_ws(a, b, offsets, E, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor

    K, N = a.shape[1], b.shape[1]
    out = torch.empty(E, K, N, dtype=a.dtype, device=a.device)
    bk, bn, br = cfg["BLOCK_K"], cfg["BLOCK_N"], cfg["BLOCK_R"]
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [br, bk])
    b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()), [br, bn])
    c_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [1, bk, bn])
    total = E * triton.cdiv(K, bk) * triton.cdiv(N, bn)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(total, sms),)
    _wgrad_ws_kernel[grid](a_desc, b_desc, c_desc, a, b, out, offsets, E, K, N, a.stride(0), b.stride(0),
                           WS=cfg["ws"], FLATTEN=cfg["flatten"], STORE_TMA=cfg["store_tma"],
                           BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _name(cfg):
    return (f"k{cfg['BLOCK_K']}n{cfg['BLOCK_N']}r{cfg['BLOCK_R']}s{cfg['num_stages']}w{cfg['num_warps']}"
            f"{'-ws' if cfg['ws'] else ''}{'-fl' if cfg['flatten'] else ''}{'-tmastore' if cfg['store_tma'] else ''}")


def main():
    import triton.testing

    from moe_kernels.triton.grouped_gemm_kernels import grouped_wgrad_launch
    from moe_kernels.triton.tuning import tuned_configs

    def alloc(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")  # noqa: E731
    base = dict(BLOCK_K=128, BLOCK_N=256, BLOCK_R=64, num_warps=8, num_stages=3)
    cfgs = []
    for ws in (False, True):
        for store_tma in (False, True):
            cfgs.append(dict(base, ws=ws, flatten=False, store_tma=store_tma))
    cfgs.append(dict(base, ws=False, flatten=True, store_tma=True))
    cfgs.append(dict(base, num_stages=4, BLOCK_N=128, ws=True, flatten=False, store_tma=True))
    cfgs.append(dict(base, num_stages=4, ws=True, flatten=False, store_tma=True, BLOCK_R=32))
    results = []
    for name, (T, d, h, k) in {"b": (16384, 4096, 4096, 4), "a": (16384, 2048, 1024, 8)}.items():
        for E in (128, 8):
            for routing in ("random", "balanced"):
                g = torch.Generator(device="cuda").manual_seed(0)
                n = T * k
                if routing == "random":
                    ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices.reshape(-1)
                    counts = torch.bincount(ids, minlength=E)
                else:
                    counts = torch.full((E,), n // E, device="cuda")
                offs = torch.cumsum(counts, 0).to(torch.int32)
                for op, (K, N) in {"wgrad1": (d, 2 * h), "wgrad2": (h, d)}.items():
                    if name == "a" and op == "wgrad2":
                        continue
                    a = torch.randn(n, K, device="cuda", generator=g).bfloat16()
                    b = torch.randn(n, N, device="cuda", generator=g).bfloat16()
                    flops = 2 * n * K * N
                    ref = torch._grouped_mm(a.t(), b, offs=offs).float()
                    methods = {"grouped_mm": lambda: torch._grouped_mm(a.t(), b, offs=offs),
                               "package": lambda: grouped_wgrad_launch(a, b, offs, E)}
                    errors = {}
                    for cfg in cfgs:
                        fn = lambda cfg=cfg: wgrad_ws(a, b, offs, E, cfg)  # noqa: E731
                        try:
                            out = fn().float()
                            errors[_name(cfg)] = ((out - ref).norm() / ref.norm()).item()
                            methods[_name(cfg)] = fn
                        except Exception as exc:  # noqa: BLE001
                            errors[_name(cfg)] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    grouped_wgrad_launch(a, b, offs, E)
                    times = {m: [] for m in methods}
                    for _ in range(2):
                        for m, fn in methods.items():
                            times[m].append(bench(fn))
                    tflops = {m: flops / min(t) / 1e9 for m, t in times.items()}
                    row = dict(shape=name, E=E, routing=routing, op=op, rows=n, K=K, N=N, tflops=tflops,
                               ms=times, rel_err=errors)
                    results.append(row)
                    print(name, E, routing, op, {m: round(v) for m, v in tflops.items()},
                          {m: (round(v, 4) if isinstance(v, float) else v) for m, v in errors.items()}, flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, commit=commit,
               package_tuned={str(k): v for k, v in tuned_configs().items()}, results=results)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
