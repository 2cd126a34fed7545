"""Grouped weight gradient on Hopper (sm_90) as a cooperative Gluon kernel with a store warp.

dW[e] = A[rows of e]^T @ B[rows of e] with a: [R, K], b: [R, N] in expert order and offsets the
device cumulative row ends. At E=128 an expert owns ~512 rows, so one output tile reduces over
only a few row chunks, and a kernel that fills its pipeline and stores its tile between tiles
leaves the tensor cores idle a third of the time (bench/NOTES.md). Here one persistent program
per SM runs four partitions on 128x256 tiles of dW:
  loader     one warp issuing TMA loads of (A chunk, B chunk) into a ring of stages, tile after
             tile, without waiting for any epilogue;
  consumers  two warpgroups on the same tile, 64 rows of dW each (one m64n256k16 MMA per
             warpgroup and 16 rows reduced: cuBLAS's cooperative shape, which needs fewer
             shared-memory bytes per FLOP than two independent 128x128 tiles);
  storer     one warp: at the end of a tile each consumer writes its accumulator to its own
             shared buffer and goes straight on to the next tile; the storer TMA-stores both
             halves and frees the buffers.
Rows past an expert's end in its last chunk belong to the next expert (or are zero-filled past
the tensor's end); each consumer zeroes them in shared memory before that chunk's MMA, so no
value of another expert can reach the tile (not even a NaN). Empty experts get zeros.

Only used where the whole path was checked: triton versions in TESTED_TRITON, a GPU of compute
capability 9.0, 16-bit a/b/out of one dtype, K a multiple of the tile height, 16-byte aligned
rows. The caller (grouped_gemm_kernels.grouped_wgrad_launch) offers it as tuning candidates.
"""

from __future__ import annotations

import torch
import triton

# The Gluon API is experimental and changes between triton releases: the kernel below is
# offered only on the versions it was run and checked on (the H200's triton 3.6).
TESTED_TRITON = ("3.6",)

try:
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

    _HAVE_GLUON = True
except ImportError:  # an older triton without Gluon
    _HAVE_GLUON = False

TILE_K = 128  # output tile rows (the K dimension of dW): two halves of 64, one per consumer
TILE_N = 256  # output tile columns
SHARED_BYTES = 227 * 1024  # an sm_90 program's shared-memory limit


def gluon_wgrad_available() -> bool:
    """Whether this triton has the Gluon API the kernel was checked with."""
    return _HAVE_GLUON and any(triton.__version__.startswith(v) for v in TESTED_TRITON)


def gluon_wgrad_supports(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, gather) -> bool:
    """Whether the Gluon kernel can run this problem (else the caller uses its Triton kernel)."""
    if not (gluon_wgrad_available() and a.is_cuda and gather is None):
        return False
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype or out_dtype != a.dtype:
        return False
    K, N = a.shape[1], b.shape[1]
    rows_ok = all(t.stride(1) == 1 and (t.stride(0) * 2) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))
    return rows_ok and K % TILE_K == 0 and N % 8 == 0 and a.shape[0] == b.shape[0] and a.shape[0] > 0


def shared_bytes(chunk_rows: int, stages: int) -> int:
    """Shared memory of one program: the ring of (two A halves, B) stages and the two output halves."""
    return 2 * (stages * chunk_rows * (TILE_K + TILE_N) + TILE_K * TILE_N)


if _HAVE_GLUON:

    @gluon.jit
    def _tile_coords(t, num_k, num_n, offsets_ptr):
        """Tile t in expert-major order: (expert, K-tile, N-tile, first row, row end)."""
        per_expert = num_k * num_n
        e = t // per_expert
        rest = t - e * per_expert
        # int32 row coordinates (TMA takes no others), whether the offsets come as int32 or int64
        end = gl.load(offsets_ptr + e).to(gl.int32)
        start = gl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(gl.int32)
        return e, rest // num_n, rest % num_n, start, end

    @gluon.jit
    def _zero_rows_from(buf, valid, layout: gl.constexpr):
        """Zero rows valid.. of a [CHUNK, W] shared tile (rows of the next expert or padding)."""
        v = buf.load(layout)
        rows = gl.arange(0, buf.type.shape[0], gl.SliceLayout(1, layout))
        buf.store(gl.where((rows < valid)[:, None], v, gl.zeros_like(v)))

    @gluon.jit
    def _loader(a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, total, num_k, num_n):
        HALF_K: gl.constexpr = a_desc.block_type.shape[1]
        CHUNK: gl.constexpr = a_desc.block_type.shape[0]
        TN: gl.constexpr = b_desc.block_type.shape[1]
        STAGES: gl.constexpr = b_bufs.type.shape[0]
        count = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            e, kt, nt, start, end = _tile_coords(t, num_k, num_n, offsets_ptr)
            for r0 in range(start, end, CHUNK):
                s = count % STAGES
                # a fresh barrier counts as phase 1 complete: the first pass through the ring does not wait
                mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                k0 = kt * 2 * HALF_K
                tma.async_copy_global_to_shared(a_desc, [r0, k0], ready.index(s), a_bufs.index(2 * s))
                tma.async_copy_global_to_shared(a_desc, [r0, k0 + HALF_K], ready.index(s), a_bufs.index(2 * s + 1))
                tma.async_copy_global_to_shared(b_desc, [r0, nt * TN], ready.index(s), b_bufs.index(s))
                count += 1

    @gluon.jit
    def _consumer(offsets_ptr, a_bufs, b_bufs, ready, empty, c_bufs, acc_ready, acc_free, total, num_k, num_n,
                  WHICH: gl.constexpr):
        CHUNK: gl.constexpr = a_bufs.type.shape[1]
        HALF_K: gl.constexpr = a_bufs.type.shape[2]
        TN: gl.constexpr = b_bufs.type.shape[2]
        STAGES: gl.constexpr = b_bufs.type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, TN, 16])
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        c_buf = c_bufs.index(WHICH)
        count = 0
        tiles = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            e, kt, nt, start, end = _tile_coords(t, num_k, num_n, offsets_ptr)
            n_chunks = (end - start + CHUNK - 1) // CHUNK
            acc = gl.zeros([HALF_K, TN], gl.float32, acc_layout)
            for i in range(n_chunks):
                # Both consumers take every stage in order, so neither can wait on a slot more than
                # one lap of the ring away from the chunk it wants (phases are parity bits).
                s = count % STAGES
                mbarrier.wait(ready.index(s), (count // STAGES) & 1)
                a_s = a_bufs.index(2 * s + WHICH)
                b_s = b_bufs.index(s)
                valid = end - (start + i * CHUNK)
                if valid < CHUNK:
                    _zero_rows_from(a_s, valid, rows_layout)
                    _zero_rows_from(b_s, valid, rows_layout)  # both consumers write the same zeros
                    fence_async_shared()
                    gl.thread_barrier()
                acc = warpgroup_mma(a_s.permute((1, 0)), b_s, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # the MMA of the previous chunk has finished: this consumer is done with its stage
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=i > 0)
                count += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=n_chunks > 0)
            # hand the half tile to the storer and go on; wait only until it has stored the last one
            mbarrier.wait(acc_free.index(WHICH), (tiles & 1) ^ 1)
            c_buf.store(acc.to(c_buf.dtype))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(acc_ready.index(WHICH))
            tiles += 1

    @gluon.jit
    def _storer(c_desc, c_bufs, acc_ready, acc_free, total, num_k, num_n):
        HALF_K: gl.constexpr = c_desc.block_type.shape[0]
        TN: gl.constexpr = c_desc.block_type.shape[1]
        k_total = num_k * 2 * HALF_K
        per_expert = num_k * num_n
        tiles = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            e = t // per_expert
            rest = t - e * per_expert
            row0 = e * k_total + (rest // num_n) * 2 * HALF_K
            for c in gl.static_range(2):
                mbarrier.wait(acc_ready.index(c), tiles & 1)
                tma.async_copy_shared_to_global(c_desc, [row0 + c * HALF_K, (rest % num_n) * TN], c_bufs.index(c))
            tma.store_wait(0)
            for c in gl.static_range(2):
                mbarrier.arrive(acc_free.index(c))
            tiles += 1

    @gluon.jit
    def _gluon_wgrad_kernel(a_desc, b_desc, c_desc, offsets_ptr, total, num_k, num_n, STAGES: gl.constexpr):
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
            (_consumer, (offsets_ptr, a_bufs, b_bufs, ready, empty, c_bufs, acc_ready, acc_free, total, num_k, num_n,
                         gl.constexpr(0))),
            (_consumer, (offsets_ptr, a_bufs, b_bufs, ready, empty, c_bufs, acc_ready, acc_free, total, num_k, num_n,
                         gl.constexpr(1))),
            (_loader, (a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, total, num_k, num_n)),
            (_storer, (c_desc, c_bufs, acc_ready, acc_free, total, num_k, num_n)),
        ], [4, 1, 1], [208, 40, 40])


def _layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def gluon_wgrad_launch(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, num_sms: int, *,
                       chunk_rows: int = 32, stages: int = 6) -> None:
    """out[e] = a[rows of e]^T @ b[rows of e], written in place; requires gluon_wgrad_supports(...).
    chunk_rows / stages: rows reduced per pipeline stage and ring depth (the tuner tries a few)."""
    if chunk_rows not in (16, 32, 64, 128) or stages < 2:
        raise ValueError(f"chunk_rows={chunk_rows}, stages={stages}: expected chunk_rows one of 16, 32, 64, 128 "
                         f"and stages >= 2")
    if shared_bytes(chunk_rows, stages) > SHARED_BYTES:
        raise ValueError(f"chunk_rows={chunk_rows}, stages={stages}: {shared_bytes(chunk_rows, stages)} bytes of "
                         f"shared memory, over the {SHARED_BYTES} an sm_90 program has")
    E, K, N = out.shape
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    half = TILE_K // 2
    a_block, b_block, c_block = [chunk_rows, half], [chunk_rows, TILE_N], [half, TILE_N]
    a_desc = GluonDescriptor(a, list(a.shape), list(a.stride()), a_block, _layout(a_block, gdt))
    b_desc = GluonDescriptor(b, list(b.shape), list(b.stride()), b_block, _layout(b_block, gdt))
    c_desc = GluonDescriptor(out.view(E * K, N), [E * K, N], [N, 1], c_block, _layout(c_block, gdt))
    num_k, num_n = K // TILE_K, triton.cdiv(N, TILE_N)
    total = E * num_k * num_n
    grid = (max(1, min(num_sms, total)),)
    # 12 warps (two consumer warpgroups; the loader's and storer's warps) share the SM's 64K registers
    _gluon_wgrad_kernel[grid](a_desc, b_desc, c_desc, offsets, total, num_k, num_n, STAGES=stages, num_warps=4,
                              maxnreg=168)
