"""Experiment (written 2026-12-04, compiled for sm_90 with triton 3.6 but NOT yet run on a GPU):
a cooperative grouped wgrad in Gluon whose epilogue leaves the consumers at once.

Why (bench/NOTES.md, end): the ping-pong wgrad (moe_kernels/triton/gluon_wgrad.py) holds two
independent 128x128 tiles per SM and, by the arithmetic there, needs more shared-memory bytes per
clock than the SM has; cuBLAS's cooperative 128x256 tile does not, but stalls at each tile's
epilogue, which at E=128 (~512 rows per expert, ~8 row chunks per tile) leaves its tensor pipes
idle ~1/3 of the time. Here both consumer warpgroups work on one 128x256 tile (64 rows of dW
each, one m64n256k16 MMA per warpgroup and 16 rows), and at the end of a tile each dumps its
accumulator to its own shared buffer and goes straight on to the next tile, whose stages the
loader warp has already filled; a store warp writes the buffers out with TMA stores and frees
them. Rows past an expert's end are zeroed in shared memory by each consumer before its MMA (A:
its own half; B: both write the same zeros), so no other expert's value reaches a tile.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_gluon_wgrad_coop.py [out.json]

Checks every variant against grouped_mm on odd counts, empty experts and NaN rows of neighbours
before timing; then (a)/(b) E=128/8 against grouped_mm, the package's tuned wgrad and the
ping-pong kernel, two interleaved rounds.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from explore_common import interleaved_tflops, routed_problems, write_report

from moe_kernels.triton.gluon_wgrad import _tile_coords, _zero_rows_from

TILE_K, TILE_N = 128, 256  # dW tile: rows (two halves of 64, one per consumer) x columns


@gluon.jit
def _coop_loader(a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, total, num_k, num_n):
    HALF_K: gl.constexpr = a_desc.block_type.shape[1]
    CHUNK: gl.constexpr = a_desc.block_type.shape[0]
    TN: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    count = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, kt, nt, start, end = _tile_coords(t, num_k, num_n, offsets_ptr)
        for r0 in range(start, end, CHUNK):
            s = count % STAGES
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [r0, kt * 2 * HALF_K], ready.index(s), a_bufs.index(2 * s))
            tma.async_copy_global_to_shared(a_desc, [r0, kt * 2 * HALF_K + HALF_K], ready.index(s),
                                            a_bufs.index(2 * s + 1))
            tma.async_copy_global_to_shared(b_desc, [r0, nt * TN], ready.index(s), b_bufs.index(s))
            count += 1


@gluon.jit
def _coop_consumer(offsets_ptr, a_bufs, b_bufs, ready, empty, c_bufs, acc_ready, acc_free, total, num_k, num_n,
                   WHICH: gl.constexpr):
    CHUNK: gl.constexpr = a_bufs.type.shape[1]
    HALF_K: gl.constexpr = a_bufs.type.shape[2]
    TN: gl.constexpr = b_bufs.type.shape[2]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TN, 16])
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    c_buf = c_bufs.index(WHICH)
    count = 0
    tiles = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, kt, nt, start, end = _tile_coords(t, num_k, num_n, offsets_ptr)
        n_chunks = (end - start + CHUNK - 1) // CHUNK
        acc = gl.zeros([HALF_K, TN], gl.float32, acc_layout)
        for i in range(n_chunks):
            s = count % STAGES
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            a_s = a_bufs.index(2 * s + WHICH)
            b_s = b_bufs.index(s)
            valid = end - (start + i * CHUNK)
            if valid < CHUNK:
                _zero_rows_from(a_s, valid, rows_layout)
                _zero_rows_from(b_s, valid, rows_layout)
                fence_async_shared()
                gl.thread_barrier()
            acc = warpgroup_mma(a_s.permute((1, 0)), b_s, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=i > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=n_chunks > 0)
        # hand the tile to the store warp and go on: wait only until it has written out the last one
        mbarrier.wait(acc_free.index(WHICH), (tiles & 1) ^ 1)
        c_buf.store(acc.to(c_buf.dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(acc_ready.index(WHICH))
        tiles += 1


@gluon.jit
def _coop_storer(c_desc, offsets_ptr, c_bufs, acc_ready, acc_free, total, num_k, num_n):
    HALF_K: gl.constexpr = c_desc.block_type.shape[0]
    TN: gl.constexpr = c_desc.block_type.shape[1]
    K_total = num_k * 2 * HALF_K
    tiles = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        per_expert = num_k * num_n
        e = t // per_expert
        rest = t - e * per_expert
        kt = rest // num_n
        nt = rest % num_n
        for c in gl.static_range(2):
            mbarrier.wait(acc_ready.index(c), tiles & 1)
            tma.async_copy_shared_to_global(c_desc, [e * K_total + kt * 2 * HALF_K + c * HALF_K, nt * TN], c_bufs.index(c))
        tma.store_wait(0)
        for c in gl.static_range(2):
            mbarrier.arrive(acc_free.index(c))
        tiles += 1


@gluon.jit
def _coop_wgrad_kernel(a_desc, b_desc, c_desc, offsets_ptr, total, num_k, num_n, STAGES: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    acc_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release every stage
    for i in gl.static_range(2):
        mbarrier.init(acc_ready.index(i), count=1)
        mbarrier.init(acc_free.index(i), count=1)
    gl.warp_specialize([
        (_coop_consumer, (offsets_ptr, a_bufs, b_bufs, ready, empty, c_bufs, acc_ready, acc_free, total, num_k, num_n,
                          gl.constexpr(0))),
        (_coop_consumer, (offsets_ptr, a_bufs, b_bufs, ready, empty, c_bufs, acc_ready, acc_free, total, num_k, num_n,
                          gl.constexpr(1))),
        (_coop_loader, (a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, total, num_k, num_n)),
        (_coop_storer, (c_desc, offsets_ptr, c_bufs, acc_ready, acc_free, total, num_k, num_n)),
    ], [4, 1, 1], [208, 40, 40])


def _layout(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def coop_wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, E: int, chunk: int, stages: int) -> torch.Tensor:
    """dW[e] = a[rows of e]^T @ b[rows of e]; bf16, K % 128 == 0, N % 8 == 0."""
    K, N = a.shape[1], b.shape[1]
    assert K % TILE_K == 0 and N % 8 == 0
    out = torch.empty(E, K, N, dtype=a.dtype, device=a.device)
    half = TILE_K // 2
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [chunk, half], _layout([chunk, half]))
    b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()), [chunk, TILE_N], _layout([chunk, TILE_N]))
    c_desc = TensorDescriptor(out.view(E * K, N), [E * K, N], [N, 1], [half, TILE_N], _layout([half, TILE_N]))
    num_k, num_n = K // TILE_K, triton.cdiv(N, TILE_N)
    total = E * num_k * num_n
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    _coop_wgrad_kernel[(max(1, min(sms, total)),)](a_desc, b_desc, c_desc, offsets, total, num_k, num_n,
                                                  STAGES=stages, num_warps=4, maxnreg=168)
    return out


VARIANTS = {"coop-r64s3": (64, 3), "coop-r32s6": (32, 6)}


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
    out = coop_wgrad(a, b, offs, E, *VARIANTS[variant]).float()
    ref = torch._grouped_mm(a.nan_to_num(0.0).t(), b.nan_to_num(0.0), offs=offs).float()
    for e in (0, 1, 2, 4, 5, 6, 7):
        assert torch.isfinite(out[e]).all(), (variant, e)
        err = ((out[e] - ref[e]).norm() / ref[e].norm().clamp_min(1e-30)).item()
        assert err < 1e-2 or (counts[e] == 0 and torch.all(out[e] == 0)), (variant, e, err)


def main():
    from moe_kernels.triton import grouped_gemm_kernels as gg
    from moe_kernels.triton.gluon_wgrad import gluon_wgrad_launch

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
                gluon_wgrad_launch(a, b, offs, out, sms)
                return out

            methods = {"grouped_mm": lambda: torch._grouped_mm(a.t(), b, offs=offs),
                       "package_tuned": lambda: gg.grouped_wgrad_launch(a, b, offs, E),
                       "gluon_pingpong": pingpong}
            errors = {}
            for v, (chunk, stages) in VARIANTS.items():
                fn = lambda chunk=chunk, stages=stages: coop_wgrad(a, b, offs, E, chunk, stages)  # noqa: E731
                errors[v] = ((fn().float() - ref).norm() / ref.norm()).item()
                methods[v] = fn
            methods["package_tuned"]()
            times, tflops = interleaved_tflops(methods, flops)
            results.append(dict(shape=name, E=E, op=op, rows=n, K=K, N=N, tflops=tflops, ms=times, rel_err=errors))
            print(name, E, op, {m: round(v) for m, v in tflops.items()}, errors, flush=True)
    write_report(results, "explore_gluon_wgrad_coop.py")


if __name__ == "__main__":
    main()
