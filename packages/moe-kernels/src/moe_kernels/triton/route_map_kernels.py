"""Route map on the device: block histogram, one-program scan, stable scatter.

Rows are the flat (token, slot) indices t*k + s. Each block of rows counts its experts
(histogram); one program turns the [blocks, experts] counts into per-expert offsets and the
first destination row of every (block, expert) (scan); each block then places its rows,
stable within an expert (scatter). No atomics, so the result is deterministic, and nothing
is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_histogram_kernel(ids_ptr, hist_ptr, R, E_P2: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    b = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    run = tl.zeros([E_P2], dtype=tl.int32)
    for c in range(CHUNKS):
        rows = (b * CHUNKS + c) * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + rows, mask=rows < R, other=-1).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        run += tl.sum(hit, axis=0)
    tl.store(hist_ptr + b * E_P2 + experts, run)


@triton.jit
def _scan_kernel(hist_ptr, base_ptr, counts_ptr, offsets_ptr, NB, E, NB_P2: tl.constexpr, E_P2: tl.constexpr):
    blocks = tl.arange(0, NB_P2)
    experts = tl.arange(0, E_P2)
    idx = blocks[:, None] * E_P2 + experts[None, :]
    bmask = blocks[:, None] < NB
    h = tl.load(hist_ptr + idx, mask=bmask, other=0)
    counts = tl.sum(h, axis=0)
    ends = tl.cumsum(counts, axis=0)
    base = (ends - counts)[None, :] + tl.cumsum(h, axis=0) - h
    tl.store(base_ptr + idx, base, mask=bmask)
    emask = experts < E
    tl.store(counts_ptr + experts, counts, mask=emask)
    tl.store(offsets_ptr + experts, ends, mask=emask)


@triton.jit
def _scatter_kernel(
    ids_ptr, base_ptr, dest_ptr, order_ptr, R, E_P2: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr
):
    b = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    run = tl.load(base_ptr + b * E_P2 + experts)
    for c in range(CHUNKS):
        rows = (b * CHUNKS + c) * CHUNK + tl.arange(0, CHUNK)
        m = rows < R
        ids = tl.load(ids_ptr + rows, mask=m, other=-1).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit
        pos = tl.sum(hit * (run[None, :] + rank), axis=1)
        run += tl.sum(hit, axis=0)
        tl.store(dest_ptr + rows, pos.to(tl.int64), mask=m)
        tl.store(order_ptr + pos, rows.to(tl.int64), mask=m)


def route_map_tensors(expert_ids: torch.Tensor, num_experts: int):
    """expert_ids: [T, k] int -> (counts [E] i32, offsets [E] i32, sort_order [T*k] i64, dest_row [T*k] i64).

    Ids outside [0, num_experts) are not checked (that would need a host read); the reference
    backend raises on them.
    """
    ids = expert_ids.reshape(-1).contiguous()
    R = ids.numel()
    dev = ids.device
    e_p2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(64, 16384 // e_p2))
    nb_max = max(8, min(128, 32768 // e_p2))
    chunks = triton.next_power_of_2(max(1, triton.cdiv(R, nb_max * chunk)))
    nb = max(1, triton.cdiv(R, chunk * chunks))
    hist = torch.empty(nb, e_p2, dtype=torch.int32, device=dev)
    base = torch.empty_like(hist)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    offsets = torch.empty_like(counts)
    dest_row = torch.empty(R, dtype=torch.int64, device=dev)
    sort_order = torch.empty(R, dtype=torch.int64, device=dev)
    warps = 8 if e_p2 * chunk >= 8192 else 4
    _block_histogram_kernel[(nb,)](ids, hist, R, E_P2=e_p2, CHUNK=chunk, CHUNKS=chunks, num_warps=warps)
    _scan_kernel[(1,)](
        hist, base, counts, offsets, nb, num_experts, NB_P2=triton.next_power_of_2(nb), E_P2=e_p2, num_warps=8
    )
    _scatter_kernel[(nb,)](ids, base, dest_row, sort_order, R, E_P2=e_p2, CHUNK=chunk, CHUNKS=chunks, num_warps=warps)
    return counts, offsets, sort_order, dest_row
