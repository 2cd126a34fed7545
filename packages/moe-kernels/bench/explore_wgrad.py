"""Experiment: a persistent wgrad with per-expert device-side tensor descriptors (rows past the
expert's end are zero-filled by the copy engine, so no masks and no tail loop), optionally with
Triton's loop flattening (the next tile's loads overlap this tile's store), against the
package's wgrad kernel and torch grouped_mm, on the block's wgrad shapes.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_wgrad.py
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _wgrad_persistent_kernel(
    a_ptr, b_ptr, c_ptr, offsets_ptr, E, K, N, stride_am, stride_bm,
    UPCAST: tl.constexpr, FLATTEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    per_e = num_k * num_n
    total = E * per_e
    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        e = tile // per_e
        rest = tile % per_e
        kt = rest // num_n
        nt = rest % num_n
        end = tl.load(offsets_ptr + e)
        start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
        rows = end - start
        a_desc = tl.make_tensor_descriptor(a_ptr + start.to(tl.int64) * stride_am, shape=[rows, K], strides=[stride_am, 1],
                                           block_shape=[BLOCK_R, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr + start.to(tl.int64) * stride_bm, shape=[rows, N], strides=[stride_bm, 1],
                                           block_shape=[BLOCK_R, BLOCK_N])
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            a = a_desc.load([r0, kt * BLOCK_K])
            b = b_desc.load([r0, nt * BLOCK_N])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(tl.trans(a), b, acc)
        rk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        rn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + e.to(tl.int64) * K * N + rk[:, None] * N + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rk < K)[:, None] & (rn < N)[None, :])


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def wgrad_persistent(a, b, offsets, E, cfg, flatten):
    triton.set_allocator(_alloc)
    K, N = a.shape[1], b.shape[1]
    out = torch.empty(E, K, N, dtype=a.dtype, device=a.device)
    bk, bn, br = cfg["BLOCK_K"], cfg["BLOCK_N"], cfg["BLOCK_R"]
    total = E * triton.cdiv(K, bk) * triton.cdiv(N, bn)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    grid = (min(total, sms * cfg.get("per_sm", 1)),)
    extra = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    _wgrad_persistent_kernel[grid](a, b, out, offsets, E, K, N, a.stride(0), b.stride(0),
                                   UPCAST=not a.is_cuda, FLATTEN=flatten, BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, **extra)
    return out


def main():
    if not torch.cuda.is_available():  # interpreter check of the indexing
        assert os.environ.get("TRITON_INTERPRET") == "1"
        g = torch.Generator().manual_seed(0)
        counts = torch.tensor([7, 0, 70, 1, 33])
        offs = counts.cumsum(0).to(torch.int32)
        R = int(counts.sum())
        a, b = torch.randn(R, 48, generator=g), torch.randn(R, 40, generator=g)
        out = wgrad_persistent(a, b, offs, 5, dict(BLOCK_K=32, BLOCK_N=32, BLOCK_R=32), False)
        ends = offs.tolist()
        ref = torch.stack([a[s:t].T @ b[s:t] for s, t in zip([0] + ends[:-1], ends)])
        print("max err", (out - ref).abs().max().item())
        return
    import triton.testing

    from moe_kernels.triton.grouped_gemm_kernels import grouped_wgrad_launch

    bench = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")  # noqa: E731
    cfgs = [dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=3),
            dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=4),
            dict(BLOCK_K=128, BLOCK_N=256, BLOCK_R=64, num_warps=8, num_stages=3),
            dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=3, per_sm=2)]
    for name, (T, d, h, k) in {"a": (16384, 2048, 1024, 8), "b": (16384, 4096, 4096, 4)}.items():
        for E in (8, 128):
            g = torch.Generator(device="cuda").manual_seed(0)
            ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices.reshape(-1)
            offs = torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)
            n = T * k
            for op, (K, N) in {"wgrad1": (d, 2 * h), "wgrad2": (h, d)}.items():
                a = torch.randn(n, K, device="cuda", generator=g).bfloat16()
                b = torch.randn(n, N, device="cuda", generator=g).bfloat16()
                flops = 2 * n * K * N
                ref = torch._grouped_mm(a.t(), b, offs=offs)
                line = f"{name} E={E:4d} {op}: grouped_mm {flops / bench(lambda: torch._grouped_mm(a.t(), b, offs=offs)) / 1e9:4.0f}"
                grouped_wgrad_launch(a, b, offs, E)
                line += f"  ours {flops / bench(lambda: grouped_wgrad_launch(a, b, offs, E)) / 1e9:4.0f}"
                for cfg in cfgs:
                    for flatten in (False, True):
                        try:
                            out = wgrad_persistent(a, b, offs, E, cfg, flatten)
                            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                            t = bench(lambda cfg=cfg, flatten=flatten: wgrad_persistent(a, b, offs, E, cfg, flatten))
                            line += f"  p{cfg['BLOCK_N']}s{cfg['num_stages']}x{cfg.get('per_sm', 1)}{'F' if flatten else ''} {flops / t / 1e9:4.0f}" + ("" if err < 1e-2 else f"(ERR {err:.2g})")
                        except Exception as exc:  # noqa: BLE001
                            line += f"  p{cfg['BLOCK_N']}{'F' if flatten else ''} fail:{type(exc).__name__}:{str(exc)[:80]}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
