"""Experiment kernel (bench only, moved out of the package in moe-kernels 0.6.0): the grouped
weight gradient on Hopper as a Gluon kernel with two ping-pong warpgroups.

One persistent program per SM runs three partitions: a loader warp issuing TMA loads of (A chunk,
B chunk) pairs into a ring of stages, tile after tile; and two consumer warpgroups taking
alternate 128x128 tiles, so one's epilogue overlaps the other's MMAs. It ties cuBLAS's grouped
wgrad at E=128 and trails it by ~15% at E=8 (results/h200_gluon_wgrad.json); the cooperative
128x256 kernel now in moe_kernels.triton.gluon_wgrad beats it on every shape measured
(results/h200_gluon_wgrad_coop.json), so the package dropped this one. Kept for
explore_gluon_wgrad.py, whose results it reproduces.
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from moe_kernels.triton.gluon_wgrad import _layout, _tile_coords, _zero_rows_from

_TILE_K = 128  # output tile rows (the K dimension of dW)
_TILE_N = 128  # output tile columns
_CHUNK_R = 64  # rows reduced per pipeline stage
_STAGES = 4
_TMA_STORE = True


@gluon.jit
def _wgrad_loader(a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, total, num_k, num_n):
    TILE_K: gl.constexpr = a_desc.block_type.shape[1]
    TILE_N: gl.constexpr = b_desc.block_type.shape[1]
    CHUNK: gl.constexpr = a_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    count = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, kt, nt, start, end = _tile_coords(t, num_k, num_n, offsets_ptr)
        for r0 in range(start, end, CHUNK):
            s = count % STAGES
            # a fresh barrier counts as phase 1 complete: the first pass through the ring does not wait
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [r0, kt * TILE_K], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [r0, nt * TILE_N], ready.index(s), b_bufs.index(s))
            count += 1


@gluon.jit
def _wgrad_consumer(c_desc, c_ptr, N, offsets_ptr, a_bufs, b_bufs, ready, empty, turn, c_bufs, total, num_k, num_n,
                    WHICH: gl.constexpr, EPI_TMA: gl.constexpr):
    TILE_K: gl.constexpr = a_bufs.type.shape[2]
    TILE_N: gl.constexpr = b_bufs.type.shape[2]
    CHUNK: gl.constexpr = a_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    K_total = num_k * TILE_K
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 16])
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    count = 0
    j = 0
    waits = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, kt, nt, start, end = _tile_coords(t, num_k, num_n, offsets_ptr)
        n_chunks = (end - start + CHUNK - 1) // CHUNK
        if j % 2 == WHICH:
            # Take turns with the other consumer: start on this tile's chunks only once it has
            # received its previous tile's last chunk. A barrier's phase is a parity bit, so a
            # consumer that ran two laps of the ring ahead of the loader would take a chunk of
            # an older lap for its own; the turn keeps every wait within one lap.
            mbarrier.wait(turn.index(WHICH), waits & 1, pred=j > 0)
            waits += (j > 0).to(gl.int32)
            acc = gl.zeros([TILE_K, TILE_N], gl.float32, acc_layout)
            for i in range(n_chunks):
                s = count % STAGES
                mbarrier.wait(ready.index(s), (count // STAGES) & 1)
                a_s = a_bufs.index(s)
                b_s = b_bufs.index(s)
                valid = end - (start + i * CHUNK)
                if valid < CHUNK:
                    _zero_rows_from(a_s, valid, rows_layout)
                    _zero_rows_from(b_s, valid, rows_layout)
                    fence_async_shared()
                    gl.thread_barrier()
                acc = warpgroup_mma(a_s.permute((1, 0)), b_s, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # the MMA of the previous chunk has finished: its stage can be refilled
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=i > 0)
                count += 1
            mbarrier.arrive(turn.index(1 - WHICH))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=n_chunks > 0)
            if EPI_TMA:
                c_buf = c_bufs.index(WHICH)
                tma.store_wait(0)  # this consumer's previous tile has left c_buf
                c_buf.store(acc.to(c_desc.dtype))
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(c_desc, [e * K_total + kt * TILE_K, nt * TILE_N], c_buf)
            else:
                # straight from the MMA registers: no shared memory, so the ring can be deeper
                rk = e * K_total + kt * TILE_K + gl.arange(0, TILE_K, gl.SliceLayout(1, acc_layout))
                rn = nt * TILE_N + gl.arange(0, TILE_N, gl.SliceLayout(0, acc_layout))
                ptrs = c_ptr + rk.to(gl.int64)[:, None] * N + rn[None, :]
                gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rn < N)[None, :])
        else:
            count += n_chunks
        j += 1
    tma.store_wait(0)


@gluon.jit
def _gluon_wgrad_kernel(a_desc, b_desc, c_desc, c_ptr, N, offsets_ptr, total, num_k, num_n,
                        STAGES: gl.constexpr, EPI_TMA: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    if EPI_TMA:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    else:
        c_bufs = a_bufs  # unused
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    gl.warp_specialize([
        (_wgrad_consumer, (c_desc, c_ptr, N, offsets_ptr, a_bufs, b_bufs, ready, empty, turn, c_bufs, total,
                           num_k, num_n, gl.constexpr(0), EPI_TMA)),
        (_wgrad_consumer, (c_desc, c_ptr, N, offsets_ptr, a_bufs, b_bufs, ready, empty, turn, c_bufs, total,
                           num_k, num_n, gl.constexpr(1), EPI_TMA)),
        (_wgrad_loader, (a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, total, num_k, num_n)),
    ], [4, 1], [208, 40])


def pingpong_wgrad_launch(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, num_sms: int, *,
                          chunk_rows: int = _CHUNK_R, stages: int = _STAGES, tma_store: bool = _TMA_STORE) -> None:
    """out[e] = a[rows of e]^T @ b[rows of e], written in place, on operands gluon_wgrad_supports(...) accepts.
    chunk_rows / stages / tma_store: rows per pipeline stage, ring depth, and whether tiles leave
    through shared memory and a TMA store (else straight from registers)."""
    E, K, N = out.shape
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_block, b_block = [chunk_rows, _TILE_K], [chunk_rows, _TILE_N]
    a_desc = GluonDescriptor(a, list(a.shape), list(a.stride()), a_block, _layout(a_block, gdt))
    b_desc = GluonDescriptor(b, list(b.shape), list(b.stride()), b_block, _layout(b_block, gdt))
    out2d = out.view(E * K, N)
    c_desc = GluonDescriptor(out2d, [E * K, N], [N, 1], [_TILE_K, _TILE_N], _layout([_TILE_K, _TILE_N], gdt))
    num_k, num_n = K // _TILE_K, triton.cdiv(N, _TILE_N)
    total = E * num_k * num_n
    grid = (max(1, min(num_sms, total)),)
    # 12 warps (three warpgroups: two consumers, the loader's) share the SM's 64K registers
    _gluon_wgrad_kernel[grid](a_desc, b_desc, c_desc, out, N, offsets, total, num_k, num_n, STAGES=stages,
                              EPI_TMA=tma_store, num_warps=4, maxnreg=168)
