"""The triton kernels under Triton's CPU interpreter, compared with the reference.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so the checks run
in a subprocess (this file run as a script). fp32 only: the interpreter mishandles bf16
arithmetic and truncates fp32->bf16 stores (bf16 parity runs on the GPU, test_triton_gpu.py).
"""

import os

import pytest

try:
    import numpy  # noqa: F401  (Triton's interpreter runs on numpy; `pip install moe-kernels[test]` brings it)
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False


def _check_route_map(torch, moe):
    # (200, 3, 1000): 38 blocks against a scan tile of 32, so the scan loops over two tiles
    for T, k, E, empty in [(37, 3, 5, (1, 3)), (300, 4, 256, ()), (1, 1, 1, ()), (200, 3, 1000, (0, 999))]:
        g = torch.Generator().manual_seed(T)
        allowed = torch.tensor([e for e in range(E) if e not in empty])
        ids = allowed[torch.rand(T, len(allowed), generator=g).topk(k, dim=1).indices]
        ref = moe.build_route_map(ids, E, backend="reference")
        out = moe.build_route_map(ids, E, backend="triton")
        for name in ("counts", "offsets", "sort_order", "dest_row"):
            a, b = getattr(out, name), getattr(ref, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, T, k, E)


def _check_route_map_flags_bad_ids(torch):
    """Ids outside [0, E) (negative, in the power-of-two padding, far past it) clear the device
    flag, stay out of the counts, and do not disturb where the valid rows go."""
    from moe_kernels.triton.route_map_kernels import route_map_tensors

    E = 6  # padded to 8 inside the kernels: 6 and 7 are in the padding
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, E, (50, 3), generator=g)
    counts, offsets, order, dest, ok = route_map_tensors(ids, E)
    assert int(ok) == 1
    for bad in (-1, 7, 9, 2**40):
        bad_ids = ids.clone()
        bad_ids[0, 0], bad_ids[17, 2] = bad, bad
        counts, offsets, order, dest, ok = route_map_tensors(bad_ids, E)
        assert int(ok) == 0, bad
        flat = bad_ids.reshape(-1)
        valid = (flat >= 0) & (flat < E)
        n_valid = int(valid.sum())
        assert counts.tolist() == torch.bincount(flat[valid], minlength=E).tolist(), bad
        assert int(offsets[-1]) == n_valid
        keep = valid.nonzero().squeeze(1)
        expect = keep[torch.sort(flat[keep], stable=True).indices]
        assert torch.equal(order[:n_valid], expect), bad
        assert torch.equal(dest[expect], torch.arange(n_valid)), bad


def _check_block(torch, moe):
    # odd T, empty experts, E not a power of two, d and h not multiples of any block
    # (E=256 runs here for the route map and on the GPU for the block: the interpreter is slow per tile)
    for T, d, h, E, k, empty in [(37, 40, 24, 6, 2, (0, 4)), (23, 16, 8, 12, 3, (5,))]:
        g = torch.Generator().manual_seed(T * E)
        allowed = torch.tensor([e for e in range(E) if e not in empty])
        ids = allowed[torch.rand(T, len(allowed), generator=g).topk(k, dim=1).indices]
        leaves = [
            torch.randn(T, d, generator=g),
            torch.rand(T, k, generator=g),
            torch.randn(E, d, 2 * h, generator=g) / d**0.5,
            torch.randn(E, h, d, generator=g) / h**0.5,
        ]
        rm = moe.build_route_map(ids, E, backend="triton")
        results = {}
        for backend in ("reference", "triton"):
            xs = [t.clone().requires_grad_() for t in leaves]
            out = moe.moe_ffn(xs[0], rm, xs[1], xs[2], xs[3], backend=backend)
            out.backward(torch.ones_like(out) + torch.arange(d) / d)
            results[backend] = [out] + [t.grad for t in xs]
        for a, b in zip(results["triton"], results["reference"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for e in empty:
            assert torch.all(results["triton"][3][e] == 0) and torch.all(results["triton"][4][e] == 0)
        if E != 6:
            continue
        # the unfused triton ops: permute, grouped GEMM (fwd, dgrad, wgrad), combine
        unfused = {}
        for backend in ("triton", "reference"):
            xs = [t.clone().requires_grad_() for t in leaves]
            rows = moe.permute(xs[0], rm, backend=backend)
            hmid = moe.grouped_gemm(rows, xs[2], rm.offsets, backend=backend)
            y = moe.grouped_gemm(hmid[:, :h].contiguous(), xs[3], rm.offsets, backend=backend)
            out = moe.combine(y, rm, xs[1], backend=backend)
            out.sum().backward()
            unfused[backend] = [out] + [t.grad for t in xs]
        for a, b in zip(unfused["triton"], unfused["reference"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _check_tensor_descriptor_paths(torch):
    """The TMA (tensor-descriptor) variants of the grouped GEMM kernels: forward, transposed B
    (dgrad) and wgrad, with an empty expert and sizes that are no multiple of the blocks. On the
    GPU they run only for bf16/fp16; here they are forced on fp32 data to check their indexing."""
    import moe_kernels.triton.grouped_gemm_kernels as gg

    gg._tma_capable = lambda t: True
    gg._CPU_GEMM = [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, tma=True)]
    gg._CPU_WGRAD = [dict(BLOCK_K=32, BLOCK_N=32, BLOCK_R=32, tma=True)]
    g = torch.Generator().manual_seed(3)
    E, K, N = 5, 48, 40
    counts = [7, 0, 33, 1, 20]
    ends = torch.tensor(counts).cumsum(0)
    offs, R = ends.to(torch.int32), int(ends[-1])
    spans = list(zip([0] + ends[:-1].tolist(), ends.tolist()))
    a, dy = torch.randn(R, K, generator=g), torch.randn(R, N, generator=g)
    w, wt = torch.randn(E, K, N, generator=g), torch.randn(E, N, K, generator=g)
    c = gg.grouped_gemm_launch(a, w, offs, out_cols=N, c=torch.empty(R, N))
    torch.testing.assert_close(c, torch.cat([a[s:t] @ w[e] for e, (s, t) in enumerate(spans)]), rtol=1e-4, atol=1e-4)
    c = gg.grouped_gemm_launch(a, wt.transpose(1, 2), offs, out_cols=N, c=torch.empty(R, N))
    torch.testing.assert_close(c, torch.cat([a[s:t] @ wt[e].T for e, (s, t) in enumerate(spans)]), rtol=1e-4, atol=1e-4)
    dw = gg.grouped_wgrad_launch(a, dy, offs, E)
    torch.testing.assert_close(dw, torch.stack([a[s:t].T @ dy[s:t] for s, t in spans]), rtol=1e-4, atol=1e-4)


def _check_block_plans(torch, moe):
    """GEMM plans that mix our Triton kernels with torch grouped_mm (its CPU kernel here), routed
    and on sorted rows, against the reference."""
    from moe_kernels.triton.ffn_kernels import ALL_GROUPED_MM, BlockPlan, swiglu_ffn_routed, swiglu_ffn_sorted

    plans = [
        ALL_GROUPED_MM,
        BlockPlan("grouped_mm", "triton", "triton", "grouped_mm", "grouped_mm", "triton"),
        BlockPlan("fused", "grouped_mm", "grouped_mm", "triton", "triton", "grouped_mm"),
        BlockPlan("triton", "triton", "fused", "triton", "triton", "triton"),
        BlockPlan("triton", "grouped_mm", "triton", "grouped_mm", "grouped_mm", "grouped_mm"),
    ]
    T, d, h, E, k = 29, 24, 40, 6, 2
    g = torch.Generator().manual_seed(5)
    allowed = torch.tensor([0, 1, 3, 5])  # experts 2 and 4 empty
    ids = allowed[torch.rand(T, len(allowed), generator=g).topk(k, dim=1).indices]
    rm = moe.build_route_map(ids, E, backend="reference")
    leaves = [torch.randn(T, d, generator=g), torch.rand(T, k, generator=g),
              torch.randn(E, d, 2 * h, generator=g) / d**0.5, torch.randn(E, h, d, generator=g) / h**0.5]
    grad = torch.randn(T, d, generator=g)
    ref = [t.clone().requires_grad_() for t in leaves]
    moe.moe_ffn(ref[0], rm, ref[1], ref[2], ref[3], backend="reference").backward(grad)
    ref_out = moe.moe_ffn(*[t.detach() for t in ref[:1]], rm, ref[1].detach(), ref[2].detach(), ref[3].detach(), backend="reference")
    rows = leaves[0][rm.source_token]
    ref_sorted = moe.swiglu_experts(rows, leaves[2], leaves[3], rm.offsets, backend="reference")
    for plan in plans:
        xs = [t.clone().requires_grad_() for t in leaves]
        out = swiglu_ffn_routed(xs[0], xs[1], xs[2], xs[3], rm.offsets, rm.sort_order, rm.dest_row, plan)
        out.backward(grad)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
        for a, b in zip(xs, ref):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
        out = swiglu_ffn_sorted(rows, leaves[2], leaves[3], rm.offsets, plan)
        torch.testing.assert_close(out, ref_sorted, rtol=1e-4, atol=1e-4)


def _check_plan_search(torch, moe):
    """auto's plan search (each GEMM timed both ways, then whole blocks) runs every path here with
    a stand-in clock; running out of memory while timing falls back to the all-Triton plan."""
    import warnings

    import triton.testing

    from moe_kernels import expert_ffn
    from moe_kernels.triton.ffn_kernels import ALL_TRITON, BlockPlan

    def stand_in_clock(fn, **_):
        # one time for every plan: the search tries each GEMM's every other implementation once beside the best
        # seed and stops after that sweep, so each kernel path runs (a clock that kept finding faster plans ran twice
        # the plans); search_plan's moves are tested in test_plan_search.py
        fn()
        return 5.0

    def out_of_memory(fn, **_):
        raise torch.cuda.OutOfMemoryError("stand-in")

    T, d, h, E, k = 9, 16, 8, 3, 2  # small: the interpreter's time grows with the tiles each plan runs
    g = torch.Generator().manual_seed(9)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    rm = moe.build_route_map(ids, E, backend="reference")
    x = torch.randn(T, d, generator=g)
    w1, w2 = torch.randn(E, d, 2 * h, generator=g), torch.randn(E, h, d, generator=g)
    saved, saved_rounds = triton.testing.do_bench, expert_ffn._PLAN_ROUNDS
    try:
        triton.testing.do_bench = stand_in_clock
        # one timing round: every plan still runs (warm-up and one timed call), and the interpreter
        # is slow per block (three rounds took ~150-270 s of the 300 s budget on 2 loaded cores)
        expert_ffn._PLAN_ROUNDS = 1
        assert isinstance(expert_ffn._time_plans(x, w1, w2, rm.offsets, (rm.sort_order, rm.dest_row, rm.top_k)), BlockPlan)
        assert isinstance(expert_ffn._time_plans(x[rm.source_token], w1, w2, rm.offsets, None), BlockPlan)
        triton.testing.do_bench = out_of_memory
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert expert_ffn._time_plans(x, w1, w2, rm.offsets, (rm.sort_order, rm.dest_row, rm.top_k)) is ALL_TRITON
        assert any("out of memory" in str(w.message) for w in caught)
    finally:
        triton.testing.do_bench, expert_ffn._PLAN_ROUNDS = saved, saved_rounds


def _check_plan_on_inference_tensors(torch, moe):
    """Tensors made under torch.inference_mode and used outside it (a cached eval batch, weights
    loaded for inference) cannot enter the plan timing's backwards: auto runs the all-Triton plan
    on them, uncached, and the block's output is right; the next ordinary call still times."""
    import itertools

    import triton.testing

    from moe_kernels import expert_ffn
    from moe_kernels.triton.ffn_kernels import ALL_TRITON

    T, d, h, E, k = 13, 16, 8, 3, 2
    g = torch.Generator().manual_seed(4)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    x, w1, w2 = torch.randn(T, d, generator=g), torch.randn(E, d, 2 * h, generator=g), torch.randn(E, h, d, generator=g)
    weights = torch.rand(T, k, generator=g)
    with torch.inference_mode():
        rm = moe.build_route_map(ids, E, backend="reference")
        inf = [t.clone() for t in (x, w1, w2, weights)]
    clock = itertools.count(1)
    saved, saved_rounds, saved_use = triton.testing.do_bench, expert_ffn._PLAN_ROUNDS, expert_ffn.use_triton
    saved_time_plans = expert_ffn._time_plans
    try:
        # auto picks triton on CUDA only: here it is told the interpreter counts, as on a GPU
        expert_ffn.use_triton = lambda backend, t: True
        triton.testing.do_bench = lambda fn, **_: (fn(), float(next(clock) % 5))[1]
        expert_ffn._PLAN_ROUNDS = 1
        expert_ffn._PLANS.clear()
        # inference weights, or only the route map made under inference_mode
        assert expert_ffn._plan("auto", inf[0], inf[1], inf[2], rm.offsets, rm) is ALL_TRITON
        assert expert_ffn._plan("auto", x, w1, w2, rm.offsets, rm) is ALL_TRITON
        assert not expert_ffn._PLANS
        out = moe.moe_ffn(inf[0], rm, inf[3], inf[1], inf[2], backend="auto")
        ref = moe.moe_ffn(x, moe.build_route_map(ids, E, backend="reference"), weights, w1, w2, backend="reference")
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
        # an ordinary call times and caches (the search itself runs in _check_plan_search: a stand-in here)
        fresh = moe.build_route_map(ids, E, backend="reference")
        timed = []
        expert_ffn._time_plans = lambda *args, **kw: timed.append(args) or ALL_TRITON
        assert expert_ffn._plan("auto", x, w1, w2, fresh.offsets, fresh) is ALL_TRITON and timed and expert_ffn._PLANS
    finally:
        triton.testing.do_bench, expert_ffn._PLAN_ROUNDS, expert_ffn.use_triton = saved, saved_rounds, saved_use
        expert_ffn._time_plans = saved_time_plans
        expert_ffn._PLANS.clear()


@pytest.mark.skipif(not HAVE_TRITON, reason="triton or numpy (its interpreter needs it) is not installed")
def test_triton_kernels_match_reference_under_interpreter(run_under_interpreter):
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    import moe_kernels as moe

    torch.set_num_threads(2)
    _check_route_map(torch, moe)
    _check_route_map_flags_bad_ids(torch)
    _check_block(torch, moe)
    _check_block_plans(torch, moe)
    _check_plan_search(torch, moe)
    _check_plan_on_inference_tensors(torch, moe)
    _check_tensor_descriptor_paths(torch)  # last: it replaces the CPU block shapes
    print("ok")
