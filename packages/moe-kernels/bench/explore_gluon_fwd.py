"""Experiment: the row-tiled grouped GEMM (C[rows of e] = A[rows of e] @ B[e], the block's fwd2 shape)
as a Gluon kernel for Hopper whose two consumer warpgroups split each 128-row tile in halves
(cooperative, like cuBLAS's 128x256 kernels: one m64n256 MMA per warpgroup and K-step), where the
second warpgroup skips its MMAs on an expert's last tile when that tile holds at most 64 rows.
At (b) E=128, 128-row tiles carry 11.5% padded rows (bench/NOTES.md); about half of that is in
tails of at most 64 rows, which this skips. Variants: with and without the skip; against torch
grouped_mm and the package's tuned Triton GEMM, random-routing counts, two interleaved rounds.

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_gluon_fwd.py [out.json]
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from explore_common import interleaved_tflops, routed_problems, write_report

BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 256, 64, 4


@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def _expert_of_tile(offsets_ptr, mt, E, BM: gl.constexpr, E_P2: gl.constexpr, W: gl.constexpr):
    """The expert owning global M-tile mt, the tile's first row and that expert's row end (W: the
    calling partition's warps)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    experts = gl.arange(0, E_P2, layout)
    emask = experts < E
    ends = gl.load(offsets_ptr + experts, mask=emask, other=0)
    starts = gl.load(offsets_ptr + experts - 1, mask=emask & (experts > 0), other=0)
    tiles = (ends - starts + BM - 1) // BM
    cum = gl.associative_scan(tiles, 0, _add)
    e = gl.sum((cum <= mt).to(gl.int32), 0)
    sel = experts == e
    e_end = gl.sum(gl.where(sel, ends, 0), 0)
    row0 = gl.sum(gl.where(sel, starts + (mt - cum + tiles) * BM, 0), 0)
    return e, row0, e_end


@gluon.jit
def _total_tiles(offsets_ptr, E, BM: gl.constexpr, E_P2: gl.constexpr, W: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    experts = gl.arange(0, E_P2, layout)
    emask = experts < E
    ends = gl.load(offsets_ptr + experts, mask=emask, other=0)
    starts = gl.load(offsets_ptr + experts - 1, mask=emask & (experts > 0), other=0)
    return gl.sum((ends - starts + BM - 1) // BM, 0)


@gluon.jit
def _fwd_loader(a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, E, K, num_n,
                E_P2: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    total = _total_tiles(offsets_ptr, E, BM, E_P2, 1) * num_n
    count = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, row0, e_end = _expert_of_tile(offsets_ptr, t // num_n, E, BM, E_P2, 1)
        n0 = (t % num_n) * BN
        for k0 in range(0, K, BK):
            s = count % STAGES_
            mbarrier.wait(empty.index(s), ((count // STAGES_) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, k0], ready.index(s), a_bufs.index(s))
            # B is [E*K, N]: K % BLOCK_K == 0, so a box never reaches the next expert's rows
            tma.async_copy_global_to_shared(b_desc, [e * K + k0, n0], ready.index(s), b_bufs.index(s))
            count += 1


@gluon.jit
def _fwd_consumer(c_ptr, N, offsets_ptr, a_bufs, b_bufs, ready, empty, E, K, num_n,
                  HALF: gl.constexpr, SKIP_TAIL: gl.constexpr, E_P2: gl.constexpr):
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[2]
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    HM: gl.constexpr = BM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    total = _total_tiles(offsets_ptr, E, BM, E_P2, 4) * num_n
    count = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, row0, e_end = _expert_of_tile(offsets_ptr, t // num_n, E, BM, E_P2, 4)
        n0 = (t % num_n) * BN
        if SKIP_TAIL and HALF == 1:
            active = e_end - row0 > HM
        else:
            active = e_end >= 0
        acc = gl.zeros([HM, BN], gl.float32, acc_layout)
        n_k = gl.cdiv(K, BK)
        for i in range(n_k):
            s = count % STAGES_
            mbarrier.wait(ready.index(s), (count // STAGES_) & 1)
            if active:
                a_s = a_bufs.index(s).slice(HALF * HM, HM)
                b_s = b_bufs.index(s)
                acc = warpgroup_mma(a_s, b_s, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((count + STAGES_ - 1) % STAGES_), pred=i > 0)
            else:
                mbarrier.arrive(empty.index(s))
            count += 1
        if active:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES_ - 1) % STAGES_), pred=n_k > 0)
            rows = row0 + HALF * HM + gl.arange(0, HM, gl.SliceLayout(1, acc_layout))
            cols = n0 + gl.arange(0, BN, gl.SliceLayout(0, acc_layout))
            ptrs = c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
            gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < e_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def _gluon_fwd_kernel(a_desc, b_desc, c_ptr, offsets_ptr, E, K, N, num_n,
                      STAGES_: gl.constexpr, SKIP_TAIL: gl.constexpr, E_P2: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES_] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES_] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES_):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release every stage
    gl.warp_specialize([
        (_fwd_consumer, (c_ptr, N, offsets_ptr, a_bufs, b_bufs, ready, empty, E, K, num_n, gl.constexpr(0),
                         SKIP_TAIL, E_P2)),
        (_fwd_consumer, (c_ptr, N, offsets_ptr, a_bufs, b_bufs, ready, empty, E, K, num_n, gl.constexpr(1),
                         SKIP_TAIL, E_P2)),
        (_fwd_loader, (a_desc, b_desc, offsets_ptr, a_bufs, b_bufs, ready, empty, E, K, num_n, E_P2)),
    ], [4, 1], [208, 40])


def gluon_fwd(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, skip_tail: bool, stages: int = STAGES) -> torch.Tensor:
    """C = A @ B[e] per expert rows; a: [R, K] bf16, b: [E, K, N] bf16 (N contiguous)."""
    E, K, N = b.shape
    c = torch.empty(a.shape[0], N, dtype=a.dtype, device=a.device)
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    assert K % BLOCK_K == 0
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [BLOCK_M, BLOCK_K], a_layout)
    b2 = b.reshape(E * K, N)
    b_desc = TensorDescriptor(b2, [E * K, N], [N, 1], [BLOCK_K, BLOCK_N], b_layout)
    num_n = triton.cdiv(N, BLOCK_N)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    _gluon_fwd_kernel[(sms,)](a_desc, b_desc, c, offsets, E, K, N, num_n, STAGES_=stages, SKIP_TAIL=skip_tail,
                              E_P2=max(256, triton.next_power_of_2(E)), num_warps=4, maxnreg=168)
    return c


def main():
    from moe_kernels.triton.grouped_gemm_kernels import grouped_gemm_launch

    results = []
    # correctness first: odd counts, empty experts, tails of 1..128 rows
    g = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.randint(0, 300, (12,), device="cuda", generator=g)
    counts[[3, 8]] = 0
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = torch.randn(int(counts.sum()), 320, device="cuda", generator=g).bfloat16()
    b = (torch.randn(12, 320, 264, device="cuda", generator=g) / 18).bfloat16()
    ref = torch._grouped_mm(a, b, offs=offs).float()
    for skip in (False, True):
        out = gluon_fwd(a, b, offs, skip).float()
        err = ((out - ref).norm() / ref.norm()).item()
        print("check skip", skip, "rel err", err, flush=True)
        assert err < 1e-2, err
    for name, T, d, h, k, E, offs, g in routed_problems((128, 8)):
        n = T * k
        K, N = h, d  # fwd2: act [rows, h] @ W2[e] [h, d]
        a = torch.randn(n, K, device="cuda", generator=g).bfloat16()
        b = (torch.randn(E, K, N, device="cuda", generator=g) / K**0.5).bfloat16()
        flops = 2 * n * K * N
        ref = torch._grouped_mm(a, b, offs=offs).float()
        c = torch.empty(n, N, dtype=a.dtype, device="cuda")
        methods = {"grouped_mm": lambda: torch._grouped_mm(a, b, offs=offs),
                   "triton_tuned": lambda: grouped_gemm_launch(a, b, offs, out_cols=N, c=c)}
        errors = {}
        for skip in (False, True):
            fn = lambda skip=skip: gluon_fwd(a, b, offs, skip)  # noqa: E731
            try:
                errors[f"gluon_skip{int(skip)}"] = ((fn().float() - ref).norm() / ref.norm()).item()
                methods[f"gluon_skip{int(skip)}"] = fn
            except Exception as exc:  # noqa: BLE001
                errors[f"gluon_skip{int(skip)}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        methods["triton_tuned"]()
        times, tflops = interleaved_tflops(methods, flops)
        results.append(dict(shape=name, E=E, op="fwd2", rows=n, K=K, N=N, tflops=tflops, ms=times, rel_err=errors))
        print(name, E, {m: round(v) for m, v in tflops.items()}, errors, flush=True)
    write_report(results, "explore_gluon_fwd.py")


if __name__ == "__main__":
    main()
