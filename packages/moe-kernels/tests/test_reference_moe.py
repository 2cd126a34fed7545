import pytest
import torch
import torch.nn.functional as F

from moe_kernels import (
    LocalDispatcher,
    build_route_map,
    combine,
    grouped_gemm,
    grouped_gemm_reference,
    moe_ffn,
    permute,
    swiglu_experts,
)


def naive_moe(x, ids, weights, w_gate_up, w_down):
    """Per-token, per-slot loop: the definition the fast paths must reproduce."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gate, up = (x[t] @ w_gate_up[e]).chunk(2)
            out[t] = out[t] + weights[t, s] * ((F.silu(gate) * up) @ w_down[e])
    return out


def random_problem(T, d, h, E, k, seed, dtype=torch.float64, empty=()):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    scores = torch.rand(T, len(allowed), generator=g)
    ids = allowed[scores.topk(k, dim=1).indices]
    weights = torch.rand(T, k, generator=g, dtype=dtype)
    x = torch.randn(T, d, generator=g, dtype=dtype)
    w1 = torch.randn(E, d, 2 * h, generator=g, dtype=dtype) / d**0.5
    w2 = torch.randn(E, h, d, generator=g, dtype=dtype) / h**0.5
    return x, ids, weights, w1, w2


def reference_block(x, ids, weights, w1, w2, backend="reference"):
    rm = build_route_map(ids, w1.shape[0])
    y = swiglu_experts(permute(x, rm), w1, w2, rm.offsets, backend)
    return combine(y, rm, weights)


@pytest.mark.parametrize("T,d,h,E,k,empty", [(13, 8, 6, 5, 2, (1, 3)), (37, 16, 12, 16, 4, (0, 15)), (9, 4, 4, 3, 3, ())])
def test_moe_block_matches_naive_loop_with_empty_experts(T, d, h, E, k, empty):
    x, ids, weights, w1, w2 = random_problem(T, d, h, E, k, seed=T * E, empty=empty)
    leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    out = reference_block(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    ref = naive_moe(ref_leaves[0], ids, ref_leaves[1], ref_leaves[2], ref_leaves[3])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
    # experts that received no token get exactly zero weight gradient
    for e in empty:
        assert torch.all(leaves[2].grad[e] == 0) and torch.all(leaves[3].grad[e] == 0)


def test_route_map_counts_offsets_and_inverse():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2]])
    rm = build_route_map(ids, 5)
    assert rm.counts.tolist() == [2, 1, 4, 1, 0]
    assert rm.offsets.tolist() == [2, 3, 7, 8, 8]
    assert rm.counts.dtype == torch.int32 and rm.offsets.dtype == torch.int32
    flat = ids.reshape(-1)
    assert torch.equal(rm.sort_order[rm.dest_row], torch.arange(8))
    sorted_experts = flat[rm.sort_order]
    assert torch.all(sorted_experts[1:] >= sorted_experts[:-1])
    assert rm.rank_counts(1).tolist() == [8]
    with pytest.raises(ValueError, match="num_experts=5 is not divisible by ep_size=2"):
        rm.rank_counts(2)


def test_route_map_rank_counts_split_experts_contiguously():
    ids = torch.tensor([[0, 3], [1, 2], [3, 2]])
    assert build_route_map(ids, 4).rank_counts(2).tolist() == [2, 4]


@pytest.mark.parametrize("E", [1, 7, 64])
def test_grouped_gemm_torch_matches_reference_fp32(E):
    g = torch.Generator().manual_seed(E)
    counts = torch.randint(0, 5, (E,), generator=g)
    counts[0] = 0
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    N = int(counts.sum())
    x = torch.randn(N, 24, generator=g, requires_grad=True)
    w = torch.randn(E, 24, 40, generator=g, requires_grad=True)
    ref = grouped_gemm_reference(x, w, offsets)
    out = grouped_gemm(x, w, offsets, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn_like(out)
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w), gy)
    gx, gw = torch.autograd.grad(out, (x, w), gy)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)


def test_moe_block_bf16_close_to_fp32_reference():
    x, ids, weights, w1, w2 = random_problem(29, 32, 16, 8, 2, seed=3, dtype=torch.float32)
    ref = reference_block(x, ids, weights, w1, w2)
    out = reference_block(*(t.bfloat16() for t in (x,)), ids, weights.bfloat16(), w1.bfloat16(), w2.bfloat16())
    assert out.dtype == torch.bfloat16
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 2e-2


def test_local_dispatcher_round_trip_is_weighted_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 6, generator=g)
    ids = torch.randint(0, 4, (11, 2), generator=g)
    w = torch.rand(11, 2, generator=g)
    rm = build_route_map(ids, 4)
    disp = LocalDispatcher(4)
    res = disp.dispatch(x, rm)
    assert torch.equal(res.offsets, rm.offsets)
    back = disp.combine(res.rows, res, w)
    torch.testing.assert_close(back, x * w.sum(1, keepdim=True))


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match=r"expert_ids must be \[T, k\]"):
        build_route_map(torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        grouped_gemm(torch.zeros(2, 3), torch.zeros(1, 3, 4), torch.tensor([2], dtype=torch.int32), backend="cuda")


def test_tuning_keys_bucket_row_counts_to_powers_of_two():
    """Expert-parallel ranks receive a different row count every step: tuned block shapes and
    block plans are keyed by the count rounded up to a power of two, so they are not re-timed."""
    from moe_kernels.triton.tuning import rows_bucket

    assert [rows_bucket(n) for n in (0, 1, 2, 3, 1000, 1024, 1025, 131071)] == [1, 1, 2, 4, 1024, 1024, 2048, 131072]


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_empty_batch_gives_empty_outputs_and_gradients(backend):
    """A rank can receive no tokens (expert parallelism, the last micro-batch): every CPU backend
    returns [0, d] and zero weight gradients instead of failing on a reshape."""
    E, d, h, k = 4, 8, 8, 2
    rm = build_route_map(torch.zeros(0, k, dtype=torch.long), E, backend=backend)
    assert rm.counts.tolist() == [0] * E and rm.sort_order.numel() == 0
    x = torch.randn(0, d, requires_grad=True)
    w = torch.rand(0, k, requires_grad=True)
    w1 = torch.randn(E, d, 2 * h, requires_grad=True)
    w2 = torch.randn(E, h, d, requires_grad=True)
    out = moe_ffn(x, rm, w, w1, w2, backend=backend)
    assert out.shape == (0, d)
    out.sum().backward()
    assert torch.count_nonzero(w1.grad) == 0 and torch.count_nonzero(w2.grad) == 0
    assert combine(torch.zeros(0, d), rm, torch.zeros(0, k), backend=backend).shape == (0, d)


def test_auto_on_cpu_falls_back_to_the_reference_for_unaligned_rows():
    """torch's CPU grouped_mm needs rows of 16-byte multiples; h=6 fp32 (24 bytes) must not reach it."""
    E, T, d, h, k = 3, 9, 8, 6, 2
    g = torch.Generator().manual_seed(1)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    rm = build_route_map(ids, E)
    args = (torch.randn(T, d, generator=g), rm, torch.rand(T, k, generator=g),
            torch.randn(E, d, 2 * h, generator=g), torch.randn(E, h, d, generator=g))
    torch.testing.assert_close(moe_ffn(*args, backend="auto"), moe_ffn(*args, backend="reference"))
    with pytest.raises(ValueError, match=r"multiples of 16"):
        moe_ffn(*args, backend="torch")


@pytest.mark.parametrize("bad, shown", [(4, "=4 is outside"), (-1, "=-1 is outside"), (2**40, "=1099511627776 is outside")])
@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_out_of_range_expert_ids_are_named(bad, shown, backend):
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    ids[2, 1] = bad
    with pytest.raises(ValueError, match=r"expert_ids\[2, 1\]" + shown + r".*\[0, num_experts=4\)"):
        build_route_map(ids, 4, backend=backend)


def test_bad_inputs_raise_clear_errors(monkeypatch):
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="expert_ids must be an integer tensor, got dtype=torch.float32"):
        build_route_map(ids.float(), 4)
    rm = build_route_map(ids, 4)
    x32 = torch.randn(2, 8)
    w1, w2 = torch.randn(4, 8, 12), torch.randn(4, 6, 8)
    with pytest.raises(ValueError, match="w_gate_up is torch.float32 on cpu but x is torch.bfloat16"):
        moe_ffn(x32.bfloat16(), rm, torch.rand(2, 2), w1, w2)
    with pytest.raises(ValueError, match="w_down is torch.bfloat16 on cpu but x is torch.float32"):
        swiglu_experts(x32[rm.source_token], w1, w2.bfloat16(), rm.offsets)
    with pytest.raises(ValueError, match="must share dtype and device"):
        grouped_gemm(x32[rm.source_token], w1.double(), rm.offsets)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for call in (
        lambda: build_route_map(ids, 4, backend="triton"),
        lambda: moe_ffn(x32, rm, torch.rand(2, 2), w1, w2, backend="triton"),
        lambda: grouped_gemm(x32[rm.source_token], w1, rm.offsets, backend="triton"),
        lambda: permute(x32, rm, backend="triton"),
    ):
        with pytest.raises(ValueError, match=r"backend='triton' (got a tensor on device=cpu|needs triton installed)"):
            call()


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_int64_offsets_are_accepted_and_bad_offsets_are_named(backend):
    """Offsets built by the caller (e.g. torch.cumsum, which gives int64) work on every backend;
    offsets that are not cumulative row ends ending at N raise before any GEMM runs."""
    E, N, K, M = 4, 11, 8, 16
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(N, K, generator=g), torch.randn(E, K, M, generator=g)
    offs64 = torch.cumsum(torch.tensor([3, 0, 6, 2]), 0)
    assert offs64.dtype == torch.int64
    torch.testing.assert_close(grouped_gemm(x, w, offs64, backend), grouped_gemm_reference(x, w, offs64.int()))
    w2 = torch.randn(E, M // 2, K, generator=g)
    torch.testing.assert_close(
        swiglu_experts(x, w, w2, offs64, backend), swiglu_experts(x, w, w2, offs64.int(), "reference")
    )
    for bad in ([3, 2, 9, 11], [3, 3, 9, 10]):
        with pytest.raises(ValueError, match=r"must be non-decreasing cumulative row ends from 0 that end at the number of rows, 11"):
            grouped_gemm(x, w, torch.tensor(bad, dtype=torch.int32), backend)
    with pytest.raises(ValueError, match="offsets must be int32 .* got dtype=torch.float32"):
        grouped_gemm(x, w, offs64.float(), backend)
