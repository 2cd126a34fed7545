"""Experiment, written and compiled for sm_90 but NOT yet run on a GPU (the device was withdrawn
before it could run): the package's cooperative Gluon wgrad (moe_kernels.triton.gluon_wgrad) with one
shared output buffer instead of one per consumer warpgroup, so the ring of load stages can be a third
deeper in the same shared memory.

Why (bench/NOTES.md, results/h200_ncu_gluon_wgrad_coop_stalls.json): under Nsight Compute at (b) E=128
the package kernel's consumer warpgroups spend about a quarter of their stall samples waiting on the
ring's `ready` barrier, i.e. for loads, while its loader waits for free stages: the loads' latency is
not covered by the 144 KB of stages in flight. The two 32 KB output halves take the rest of the
227 KB. Here the consumers take turns on one 32 KB buffer (consumer 0's half of a tile, then
consumer 1's; the store warp hands the buffer from one to the other), which leaves room for 8 stages
of 32 rows (or 4 of 64) instead of 6 (or 3). Taking turns makes consumer 1 wait for consumer 0's half
to be stored; lead_chunks starts consumer 1 that many row chunks behind consumer 0 so the turns
overlap the other consumer's MMAs (with the per-consumer buffers of the package kernel a lead gained
nothing: results/h200_gluon_wgrad_lead.json, measured with the lead parameter the package kernel had
at commit eac69b8).

Every partition but the consumers and the store warp is the package kernel's own (loader, tile order,
zeroing of other experts' rows). Run through explore_gluon_wgrad_coop.py, which checks it against
grouped_mm (odd counts, empty experts, NaN rows of neighbours) before timing it beside the package
kernel:

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_gluon_wgrad_coop.py OUT.json
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

from moe_kernels.triton.gluon_wgrad import (
    SHARED_BYTES,
    TILE_K,
    TILE_N,
    GluonDescriptor,
    _layout,
    _loader,
    _tile_coords,
    _zero_rows_from,
)


def shared_out_bytes(chunk_rows: int, stages: int) -> int:
    """Shared memory of one program: the ring of (two A halves, B) stages and one output half tile."""
    return 2 * (stages * chunk_rows * (TILE_K + TILE_N) + TILE_K // 2 * TILE_N)


@gluon.jit
def _consumer(offsets_ptr, a_bufs, b_bufs, ready, empty, c_buf, c_ready, c_free, lead_bar, total, num_k, num_n,
              WHICH: gl.constexpr, LEAD: gl.constexpr):
    CHUNK: gl.constexpr = a_bufs.type.shape[1]
    HALF_K: gl.constexpr = a_bufs.type.shape[2]
    TN: gl.constexpr = b_bufs.type.shape[2]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, TN, 16])
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    count = 0
    tiles = 0
    if WHICH == 1:
        if LEAD > 0:
            mbarrier.wait(lead_bar, 0)  # start LEAD chunks behind consumer 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, kt, nt, start, end = _tile_coords(t, num_k, num_n, offsets_ptr)
        n_chunks = (end - start + CHUNK - 1) // CHUNK
        acc = gl.zeros([HALF_K, TN], gl.float32, acc_layout)
        for i in range(n_chunks):
            # both consumers take every stage in order: neither waits on a slot a lap away (parity phases)
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
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=i > 0)
            count += 1
            if WHICH == 0:
                if LEAD > 0:
                    if count == LEAD:
                        mbarrier.arrive(lead_bar)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=n_chunks > 0)
        # Turns on the one output buffer: consumer 0 writes once consumer 1's half of the previous
        # tile is stored (a fresh barrier lets the first tile through), consumer 1 once consumer 0's
        # half of this tile is. Each hand-off waits for the previous one, so no wait is a lap ahead.
        if WHICH == 0:
            mbarrier.wait(c_free.index(0), (tiles & 1) ^ 1)
        else:
            mbarrier.wait(c_free.index(1), tiles & 1)
        c_buf.store(acc.to(c_buf.dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(c_ready.index(WHICH))
        tiles += 1
    if WHICH == 0:
        if LEAD > 0:
            if count < LEAD:  # fewer chunks in this program than the lead: release consumer 1 now
                mbarrier.arrive(lead_bar)


@gluon.jit
def _storer(c_desc, c_buf, c_ready, c_free, total, num_k, num_n):
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
            mbarrier.wait(c_ready.index(c), tiles & 1)
            tma.async_copy_shared_to_global(c_desc, [row0 + c * HALF_K, (rest % num_n) * TN], c_buf)
            tma.store_wait(0)
            mbarrier.arrive(c_free.index(1 - c))  # the buffer goes to the other consumer
        tiles += 1


@gluon.jit
def _shared_out_wgrad_kernel(a_desc, b_desc, c_desc, offsets_ptr, total, num_k, num_n, STAGES: gl.constexpr,
                             LEAD: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    lead_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(lead_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release every stage
    for i in gl.static_range(2):
        mbarrier.init(c_ready.index(i), count=1)
        mbarrier.init(c_free.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (offsets_ptr, a_bufs, b_bufs, ready, empty, c_buf, c_ready, c_free, lead_bar, total, num_k, num_n,
                     gl.constexpr(0), LEAD)),
        (_consumer, (offsets_ptr, a_bufs, b_bufs, ready, empty, c_buf, c_ready, c_free, lead_bar, total, num_k, num_n,
                     gl.constexpr(1), LEAD)),
        (_loader, (a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, total, num_k, num_n)),
        (_storer, (c_desc, c_buf, c_ready, c_free, total, num_k, num_n)),
    ], [4, 1, 1], [208, 40, 40])


def shared_out_wgrad_launch(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, num_sms: int,
                            *, chunk_rows: int = 32, stages: int = 8, lead_chunks: int = 0) -> None:
    """out[e] = a[rows of e]^T @ b[rows of e] in place, on the operands gluon_wgrad_supports accepts."""
    if chunk_rows not in (16, 32, 64, 128) or stages < 2 or not 0 <= lead_chunks < stages:
        raise ValueError(f"chunk_rows={chunk_rows}, stages={stages}, lead_chunks={lead_chunks}: expected chunk_rows "
                         f"one of 16, 32, 64, 128, stages >= 2 and 0 <= lead_chunks < stages")
    if shared_out_bytes(chunk_rows, stages) > SHARED_BYTES:
        raise ValueError(f"chunk_rows={chunk_rows}, stages={stages}: {shared_out_bytes(chunk_rows, stages)} bytes "
                         f"of shared memory, over the {SHARED_BYTES} an sm_90 program has")
    E, K, N = out.shape
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    half = TILE_K // 2
    a_block, b_block, c_block = [chunk_rows, half], [chunk_rows, TILE_N], [half, TILE_N]
    a_desc = GluonDescriptor(a, list(a.shape), list(a.stride()), a_block, _layout(a_block, gdt))
    b_desc = GluonDescriptor(b, list(b.shape), list(b.stride()), b_block, _layout(b_block, gdt))
    c_desc = GluonDescriptor(out.view(E * K, N), [E * K, N], [N, 1], c_block, _layout(c_block, gdt))
    num_k, num_n = K // TILE_K, triton.cdiv(N, TILE_N)
    total = E * num_k * num_n
    _shared_out_wgrad_kernel[(max(1, min(num_sms, total)),)](
        a_desc, b_desc, c_desc, offsets, total, num_k, num_n, STAGES=stages, LEAD=lead_chunks, num_warps=4,
        maxnreg=168)
