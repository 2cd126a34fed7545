"""Device-scheduled grouped GEMM: forward/dgrad (one persistent kernel) and wgrad.

Rows are in expert order with exact per-expert counts (offsets: [E] int32 cumulative ends,
on the device). The forward kernel runs a persistent grid; each program walks tile ids and
finds a tile's expert by comparing the id with the cumulative per-expert M-tile counts, which
it computes itself from `offsets` (so no host read and no metadata that depends on the block
shape). Options, all compile-time:
  GATHER_A  A-row r is read from x[gather[r] // TOPK] (the permute fused into the A-load);
  EPILOGUE  0: C = A @ B;  1: SwiGLU forward, B holds [gate | up] (H columns apart):
            writes pre = [gate | up] and C = silu(gate) * up;  2: SwiGLU backward: C = d[gate | up]
            from A @ B = d_act and the saved pre.
wgrad: dW[e] = A[rows_e]^T @ B[rows_e], one program per (expert, K-tile, N-tile), looping
over that expert's rows; empty experts get zeros.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_kernels.triton.gluon_wgrad import gluon_wgrad_launch, gluon_wgrad_supports
from moe_kernels.triton.autograd_support import refuse_dual_inputs, refuse_forward_ad, run_backward, vmap_by_loop
from moe_kernels.triton.tuning import pick_config, rows_bucket


@triton.jit
def _expert_tiles(offsets_ptr, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per-expert row starts/ends, M-tile counts and their cumulative sum, from the device offsets."""
    experts = tl.arange(0, E_P2)
    emask = experts < E
    ends = tl.load(offsets_ptr + experts, mask=emask, other=0)
    starts = tl.load(offsets_ptr + experts - 1, mask=emask & (experts > 0), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    return experts, starts, ends, tiles, tl.cumsum(tiles, axis=0)


@triton.jit
def _locate_tile(mt, experts, starts, ends, tiles, cum, BLOCK_M: tl.constexpr):
    """The expert owning global M-tile `mt`, the tile's first row and that expert's row end."""
    e = tl.sum((cum <= mt).to(tl.int32), axis=0)
    sel = experts == e
    e_end = tl.sum(tl.where(sel, ends, 0), axis=0)
    row0 = tl.sum(tl.where(sel, starts + (mt - cum + tiles) * BLOCK_M, 0), axis=0)
    return e, row0, e_end


@triton.jit
def _source_rows(gather_ptr, rows, mask, TOPK: tl.constexpr, GATHER_A: tl.constexpr):
    """A's row for each row in expert order (int64): x-row gather[row] // TOPK when the permute is
    fused into the A-load, else the row itself."""
    if GATHER_A:
        src = (tl.load(gather_ptr + rows, mask=mask, other=0) // TOPK).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    return src


@triton.jit
def _load_b_tile(b_ptrs, b_desc, e, k0, n0, kmask, nmask,
                 EVEN_K: tl.constexpr, B_TMA: tl.constexpr, B_NK: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """B[e][k0:k0+BK, n0:n0+BN]; through the tensor-memory accelerator when B_TMA (zero-filled
    out of bounds; B_NK: the descriptor is over the [E, N, K] storage of a transposed B)."""
    if B_TMA:
        if B_NK:
            b = tl.trans(b_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K))
        else:
            b = b_desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    elif EVEN_K:
        b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
    else:
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
    return b


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_desc, b_ptr, b_desc, c_ptr, aux_ptr, offsets_ptr, gather_ptr,
    E, K, N, H,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn, stride_xm, stride_xn,
    TOPK: tl.constexpr, E_P2: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_NK: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    experts, starts, ends, tiles, cum = _expert_tiles(offsets_ptr, E, E_P2, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    total = tl.sum(tiles, axis=0) * num_n
    out_ty = c_ptr.dtype.element_ty
    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN, warp_specialize=WS == 1):
        mt = tile // num_n
        nt = tile % num_n
        e, row0, e_end = _locate_tile(mt, experts, starts, ends, tiles, cum, BLOCK_M)
        rm = row0 + tl.arange(0, BLOCK_M)
        mmask = rm < e_end
        src = _source_rows(gather_ptr, rm, mmask, TOPK, GATHER_A)
        n0 = nt * BLOCK_N
        rn = n0 + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + src[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + e.to(tl.int64) * stride_be + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if EPILOGUE == 1:
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WS == 2):
            kmask = (k0 + rk) < K
            if A_TMA:
                # rows past this expert's end belong to the next expert (or are zero-filled): their
                # products land only in rows the masked store below skips
                a = a_desc.load([row0, k0])
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = _load_b_tile(b_ptrs, b_desc, e, k0, n0, kmask, nmask, EVEN_K, B_TMA, B_NK, BLOCK_K, BLOCK_N)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if EPILOGUE == 1:
                b2 = _load_b_tile(b_ptrs + H * stride_bn, b_desc, e, k0, n0 + H, kmask, nmask,
                                  EVEN_K, B_TMA, B_NK, BLOCK_K, BLOCK_N)
                if UPCAST:
                    b2 = b2.to(tl.float32)
                acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        rows = rm.to(tl.int64)
        cmask = mmask[:, None] & nmask[None, :]
        c_ptrs = c_ptr + rows[:, None] * stride_cm + rn[None, :] * stride_cn
        if EPILOGUE == 0:
            tl.store(c_ptrs, acc.to(out_ty), mask=cmask)
        elif EPILOGUE == 1:
            # round to the storage dtype first, as the unfused path does
            g = acc.to(out_ty)
            u = acc2.to(out_ty)
            x_ptrs = aux_ptr + rows[:, None] * stride_xm + rn[None, :] * stride_xn
            tl.store(x_ptrs, g, mask=cmask)
            tl.store(x_ptrs + H * stride_xn, u, mask=cmask)
            gf = g.to(tl.float32)
            act = gf * tl.sigmoid(gf) * u.to(tl.float32)
            tl.store(c_ptrs, act.to(out_ty), mask=cmask)
        else:
            x_ptrs = aux_ptr + rows[:, None] * stride_xm + rn[None, :] * stride_xn
            gf = tl.load(x_ptrs, mask=cmask, other=0.0).to(tl.float32)
            uf = tl.load(x_ptrs + H * stride_xn, mask=cmask, other=0.0).to(tl.float32)
            da = acc.to(out_ty).to(tl.float32)
            sig = tl.sigmoid(gf)
            du = da * gf * sig
            dg = da * uf * sig * (1.0 + gf * (1.0 - sig))
            tl.store(c_ptrs, dg.to(out_ty), mask=cmask)
            tl.store(c_ptrs + H * stride_cn, du.to(out_ty), mask=cmask)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, a_desc, b_ptr, b_desc, c_ptr, offsets_ptr, gather_ptr, K, N,
    stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
    TOPK: tl.constexpr, GATHER_A: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, WS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    e = pid // (num_k * num_n)
    rest = pid % (num_k * num_n)
    kt = rest // num_n
    nt = rest % num_n
    end = tl.load(offsets_ptr + e)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    full_end = start + (end - start) // BLOCK_R * BLOCK_R
    rk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = rk < K
    nmask = rn < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    # whole BLOCK_R chunks of this expert's rows (no row mask), then at most one partial chunk
    for r0 in tl.range(start, full_end, BLOCK_R, warp_specialize=WS == 2):
        rr = r0 + tl.arange(0, BLOCK_R)
        if A_TMA:
            a = a_desc.load([r0, kt * BLOCK_K])
        else:
            src = _source_rows(gather_ptr, rr, rr < full_end, TOPK, GATHER_A)
            a = tl.load(a_ptr + src[:, None] * stride_am + rk[None, :] * stride_ak, mask=kmask[None, :], other=0.0)
        if B_TMA:
            b = b_desc.load([r0, nt * BLOCK_N])
        else:
            b = tl.load(b_ptr + rr.to(tl.int64)[:, None] * stride_bm + rn[None, :] * stride_bn, mask=nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    if full_end < end:
        rr = full_end + tl.arange(0, BLOCK_R)
        rmask = rr < end
        src = _source_rows(gather_ptr, rr, rmask, TOPK, GATHER_A)
        a = tl.load(a_ptr + src[:, None] * stride_am + rk[None, :] * stride_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + rr.to(tl.int64)[:, None] * stride_bm + rn[None, :] * stride_bn, mask=rmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rk[:, None] * stride_ck + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=kmask[:, None] & nmask[None, :])


# Block shapes tried per (kernel, shape, dtype); the first is the default when tuning is off
# (CPU interpreter, or a first call made during CUDA-graph capture). `tma`: operands that allow
# it (bf16/fp16 on a GPU with TMA, 16-byte aligned rows, not gathered) are read through tensor
# descriptors; the tuner keeps whichever variant is faster. `ws`: Triton's warp specialisation
# of the persistent tile loop (1) or of the K / row loop (2); on the H200 with triton 3.6 it
# gains 2-10% on some (b)/(a) E=128 GEMMs and loses on others (bench/explore_warp_spec.py), and
# it fails to compile for 4-warp tiles, so it is only ever a tuning candidate.
_GEMM_CONFIGS_BF16 = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, tma=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, tma=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, tma=False),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, tma=True),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, tma=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, tma=True, ws=1),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, tma=True, ws=2),
]
_SWIGLU_CONFIGS_BF16 = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, tma=True),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, tma=True),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, tma=True),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, tma=True, ws=1),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, tma=True, ws=2),
]
_WGRAD_CONFIGS_BF16 = [
    dict(BLOCK_K=128, BLOCK_N=256, BLOCK_R=64, num_warps=8, num_stages=3, tma=True),
    dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=4, tma=True),
    dict(BLOCK_K=128, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=3, tma=True),
    dict(BLOCK_K=256, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=3, tma=True),
    dict(BLOCK_K=64, BLOCK_N=128, BLOCK_R=64, num_warps=4, num_stages=4, tma=True),
    dict(BLOCK_K=128, BLOCK_N=256, BLOCK_R=64, num_warps=8, num_stages=3, tma=True, ws=2),
]
# the cooperative Gluon kernel (gluon_wgrad.py), candidates only where it can run: on the H200 it
# beats cuBLAS's grouped wgrad by 6-12% at E=128 and ties it at E=8
# (bench/results/h200_gluon_wgrad_coop.json)
_GLUON_WGRAD = [dict(gluon=True, chunk_rows=32, stages=6), dict(gluon=True, chunk_rows=64, stages=3)]
_GEMM_CONFIG_FP32 = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2, tma=False)]
_WGRAD_CONFIG_FP32 = [dict(BLOCK_K=64, BLOCK_N=64, BLOCK_R=32, num_warps=4, num_stages=2, tma=False)]
_CPU_GEMM = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, tma=False)]
_CPU_WGRAD = [dict(BLOCK_K=64, BLOCK_N=64, BLOCK_R=64, tma=False)]


@functools.cache
def _cuda_properties(index: int) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of a CUDA device, read once: the launches ask on every call."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, (props.major, props.minor)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _cuda_properties(device.index if device.index is not None else torch.cuda.current_device())[0]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _tma_capable(t: torch.Tensor) -> bool:
    """Whether tensor descriptors can be built for `t` at all (16-bit data on a GPU with TMA)."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and _cuda_properties(t.device.index)[1] >= (9, 0)


def _descriptor(t: torch.Tensor, block: list[int]):
    """A host tensor descriptor over `t` (last dim contiguous, 16-byte aligned base and strides), or None."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:-1]) or t.numel() == 0:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _b_descriptor(b: torch.Tensor, bk: int, bn: int):
    """(descriptor, b_nk) for B = b[e] of shape [K, N]: over b itself, or over its [E, N, K] storage."""
    if b.stride(2) == 1:
        return _descriptor(b, [1, bk, bn]), False
    if b.stride(1) == 1:
        return _descriptor(b.transpose(1, 2), [1, bn, bk]), True
    return None, False


def grouped_gemm_launch(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, out_cols: int, c: torch.Tensor,
    gather: torch.Tensor | None = None, top_k: int = 1, epilogue: int = 0, aux: torch.Tensor | None = None,
    swiglu_h: int = 0, config: dict | None = None,
) -> torch.Tensor:
    """C[r, :out_cols] = epilogue(A[src(r)] @ B[e(r)]); a: [*, K], b: [E, K, *] (any strides), c written in place.
    config: a block shape to run instead of the tuned one (tests and benchmarks)."""
    E, K = b.shape[0], b.shape[1]
    n_rows = c.shape[0]
    if n_rows == 0 or out_cols == 0:
        return c
    if K == 0:
        raise ValueError("grouped GEMM with K=0 is not supported by the triton backend")
    cpu = a.device.type == "cpu"
    if cpu:
        configs = _CPU_GEMM
    elif a.dtype == torch.float32:
        configs = _GEMM_CONFIG_FP32
    else:
        configs = _SWIGLU_CONFIGS_BF16 if epilogue else _GEMM_CONFIGS_BF16
    tma_ok = _tma_capable(a)
    aux = aux if aux is not None else c
    gather_t = gather if gather is not None else offsets
    # one compiled kernel serves every E up to 256 (the lookup vector costs nothing per tile)
    e_p2 = max(256, triton.next_power_of_2(E))
    sms = _num_sms(a.device)

    def launch(cfg):
        cfg = dict(cfg)
        bm, bn, bk, tma = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("tma") and tma_ok
        ws = cfg.pop("ws", 0)
        progs = cfg.pop("progs", 1)  # persistent programs per SM (2: one's epilogue overlaps the other's loads)
        a_desc = _descriptor(a, [bm, bk]) if tma and gather is None else None
        # the SwiGLU epilogue reads B's up half at column H: a tensor-descriptor box must start
        # 16-byte aligned there (an unaligned H faulted on the H200)
        b_tma = tma and (epilogue != 1 or (swiglu_h * b.element_size()) % 16 == 0)
        b_desc, b_nk = _b_descriptor(b, bk, bn) if b_tma else (None, False)
        upper = (triton.cdiv(n_rows, bm) + E) * triton.cdiv(out_cols, bn)
        grid = (max(1, min(progs * sms, upper)),)
        _grouped_gemm_kernel[grid](
            a, a_desc, b, b_desc, c, aux, offsets, gather_t, E, K, out_cols, swiglu_h,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
            c.stride(0), c.stride(1), aux.stride(0), aux.stride(1),
            TOPK=top_k, E_P2=e_p2, GATHER_A=gather is not None, EPILOGUE=epilogue,
            EVEN_K=K % bk == 0, UPCAST=cpu, PRECISION=_precision(a.dtype),
            A_TMA=a_desc is not None, B_TMA=b_desc is not None, B_NK=b_nk, FLATTEN=False, WS=ws,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg,
        )

    if config is not None:
        launch(config)
        return c
    key = ("gemm", epilogue, gather is not None, rows_bucket(n_rows), K, out_cols, E, b.stride(1) == 1, a.dtype)
    pick_config(key, configs, launch)
    return c


def grouped_wgrad_launch(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, num_experts: int, *,
    gather: torch.Tensor | None = None, top_k: int = 1, out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """dW[e] = A[rows of e]^T @ B[rows of e]: a: [*, K] (rows gathered via gather//top_k), b: [N_rows, N] -> [E, K, N].
    config: a block shape to run instead of the tuned one (tests and benchmarks)."""
    K, N = a.shape[1], b.shape[1]
    out = torch.empty(num_experts, K, N, dtype=out_dtype or a.dtype, device=a.device)
    if K == 0 or N == 0 or num_experts == 0:
        return out
    cpu = a.device.type == "cpu"
    if cpu:
        configs = _CPU_WGRAD
    elif a.dtype == torch.float32:
        configs = _WGRAD_CONFIG_FP32
    else:
        configs = _WGRAD_CONFIGS_BF16
        if gluon_wgrad_supports(a, b, out.dtype, gather):
            configs = configs + _GLUON_WGRAD
    tma_ok = _tma_capable(a)
    gather_t = gather if gather is not None else offsets

    def launch(cfg):
        if cfg.get("gluon"):
            if gluon_wgrad_supports(a, b, out.dtype, gather):
                gluon_wgrad_launch(a, b, offsets, out, _num_sms(a.device), chunk_rows=cfg["chunk_rows"], stages=cfg["stages"])
                return
            cfg = configs[0]  # tuned on aligned operands, called now with ones the kernel cannot take
        cfg = dict(cfg)
        bk, bn, br, tma = cfg.pop("BLOCK_K"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_R"), cfg.pop("tma") and tma_ok
        ws = cfg.pop("ws", 0)
        a_desc = _descriptor(a, [br, bk]) if tma and gather is None else None
        b_desc = _descriptor(b, [br, bn]) if tma else None
        grid = (num_experts * triton.cdiv(K, bk) * triton.cdiv(N, bn),)
        _grouped_wgrad_kernel[grid](
            a, a_desc, b, b_desc, out, offsets, gather_t, K, N,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
            TOPK=top_k, GATHER_A=gather is not None, UPCAST=cpu, PRECISION=_precision(a.dtype),
            A_TMA=a_desc is not None, B_TMA=b_desc is not None, WS=ws,
            BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, **cfg,
        )

    if config is not None:
        launch(config)
        return out
    key = ("wgrad", gather is not None, rows_bucket(b.shape[0]), K, N, num_experts, a.dtype)
    pick_config(key, configs, launch)
    return out


def grouped_gemm_forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    c = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    return grouped_gemm_launch(x, w, offsets, out_cols=w.shape[2], c=c)


class GroupedGemmFn(torch.autograd.Function):
    """x: [N, K] @ w: [E, K, M] per expert -> [N, M]; dgrad dy @ w^T, wgrad x^T @ dy over variable-length groups."""

    @staticmethod
    def forward(x, w, offsets):
        """x: contiguous (the callers make it so, inside the graph: saving a copy made here would
        need a second one in setup_context)."""
        refuse_dual_inputs("GroupedGemmFn", (x, w))
        return grouped_gemm_forward(x, w, offsets)

    @staticmethod
    def setup_context(ctx, inputs, output):
        refuse_forward_ad("GroupedGemmFn")
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, gy):
        x, w, offsets = ctx.saved_tensors
        return run_backward("GroupedGemmFn", grouped_gemm_backward, gy, x, w, offsets, tuple(ctx.needs_input_grad[:2]))

    @staticmethod
    def vmap(info, in_dims, x, w, offsets):
        return vmap_by_loop(info, in_dims, lambda x, w, o: GroupedGemmFn.apply(x.contiguous(), w, o), x, w, offsets)


def grouped_gemm_backward(gy, x, w, offsets, needs):
    """(gx, gw, None) for GroupedGemmFn, gradients only where `needs` asks."""
    gy = gy.contiguous()
    gx = gw = None
    if needs[0]:
        gx = torch.empty_like(x)
        grouped_gemm_launch(gy, w.transpose(1, 2), offsets, out_cols=x.shape[1], c=gx)
    if needs[1]:
        gw = grouped_wgrad_launch(x, gy, offsets, w.shape[0], out_dtype=w.dtype)
    return gx, gw, None
