"""Triton kernels on a CUDA GPU against the reference: route map, permute/combine, grouped GEMM,
the fused block (outputs and every gradient), determinism and CUDA-graph capture.

Run on the device: PYTHONPATH=packages/moe-kernels/src python3 -m pytest -m gpu packages/moe-kernels/tests/test_triton_gpu.py
"""

import pytest
import torch

import moe_kernels as moe
from moe_kernels import LocalDispatcher, build_route_map, moe_ffn, swiglu_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [  # T, d, h, E, k, empty experts: odd T, sizes off every block, E=256, empty experts
    (333, 200, 136, 8, 2, (3,)),
    (1025, 256, 128, 256, 8, tuple(range(0, 256, 5))),
    (77, 64, 64, 32, 4, tuple(range(1, 32))),  # every row on expert 0
]


def routing(T, E, k, empty, g):
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    k = min(k, len(allowed))
    return allowed[torch.rand(T, len(allowed), generator=g).topk(k, dim=1).indices]


def problem(T, d, h, E, k, empty, seed):
    g = torch.Generator().manual_seed(seed)
    ids = routing(T, E, k, empty, g)
    k = ids.shape[1]
    leaves = [
        torch.randn(T, d, generator=g, dtype=torch.float64),
        torch.rand(T, k, generator=g, dtype=torch.float64),
        torch.randn(E, d, 2 * h, generator=g, dtype=torch.float64) / d**0.5,
        torch.randn(E, h, d, generator=g, dtype=torch.float64) / h**0.5,
    ]
    return ids, leaves


def run_block(fn, leaves, dtype, device, grad_out):
    xs = [t.detach().to(device=device, dtype=dtype).clone().requires_grad_() for t in leaves]
    wdtype = torch.float32 if dtype != torch.float64 else dtype
    xs[1] = leaves[1].detach().to(device=device, dtype=wdtype).clone().requires_grad_()
    out = fn(*xs)
    out.backward(grad_out.to(device=device, dtype=out.dtype))
    return [out.detach().double().cpu()] + [t.grad.double().cpu() for t in xs]


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T,k,E", [(1, 1, 1), (333, 2, 8), (16383, 8, 128), (1025, 8, 256), (5, 3, 1000), (200, 3, 1000), (65537, 8, 128)])
def test_triton_route_map_equals_reference(T, k, E):
    g = torch.Generator().manual_seed(T + E)
    ids = routing(T, E, k, tuple(range(0, E, 7)) if E > 8 else (), g).cuda()
    ref = build_route_map(ids, E, backend="torch")
    out = build_route_map(ids, E, backend="triton")
    for name in ("counts", "offsets", "sort_order", "dest_row"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    if E % 4 == 0:
        assert torch.equal(out.rank_counts(4), ref.rank_counts(4))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1.5e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("case", CASES)
def test_triton_moe_block_matches_reference_outputs_and_grads(case, dtype, tol):
    T, d, h, E, k, empty = case
    ids, leaves = problem(*case, seed=T * E)
    grad_out = torch.randn(T, d, dtype=torch.float64)
    rm64 = build_route_map(ids, E, backend="reference")
    ref = run_block(lambda x, w, a, b: moe_ffn(x, rm64, w, a, b, backend="reference"), leaves, torch.float64, "cpu", grad_out)
    rm = build_route_map(ids.cuda(), E, backend="triton")
    fused = run_block(lambda x, w, a, b: moe_ffn(x, rm, w, a, b, backend="triton"), leaves, dtype, "cuda", grad_out)
    disp = LocalDispatcher(E)

    def model_path(x, w, a, b):  # the model's call sequence, every op on triton
        res = disp.dispatch(x, rm)
        return disp.combine(swiglu_experts(res.rows, a, b, res.offsets, backend="triton"), res, w)

    unfused = run_block(model_path, leaves, dtype, "cuda", grad_out)
    others = [fused, unfused]
    if dtype == torch.bfloat16:  # torch grouped_mm GEMMs between the triton row kernels; and auto's choice
        for b in ("torch", "auto"):
            others.append(run_block(lambda x, w, a, c, b=b: moe_ffn(x, rm, w, a, c, backend=b), leaves, dtype, "cuda", grad_out))

        def model_path_grouped_mm(x, w, a, b):
            res = disp.dispatch(x, rm)
            return disp.combine(swiglu_experts(res.rows, a, b, res.offsets, backend="torch"), res, w)

        others.append(run_block(model_path_grouped_mm, leaves, dtype, "cuda", grad_out))
        from moe_kernels.triton.ffn_kernels import BlockPlan, swiglu_ffn_routed

        for plan in (BlockPlan("grouped_mm", "triton", "triton", "grouped_mm", "grouped_mm", "triton"),
                     BlockPlan("fused", "grouped_mm", "grouped_mm", "triton", "triton", "grouped_mm"),
                     BlockPlan("triton", "triton", "fused", "triton", "triton", "triton"),
                     BlockPlan("triton", "grouped_mm", "triton", "grouped_mm", "grouped_mm", "grouped_mm")):
            others.append(run_block(
                lambda x, w, a, b, plan=plan: swiglu_ffn_routed(x, w, a, b, rm.offsets, rm.sort_order, rm.dest_row, plan),
                leaves, dtype, "cuda", grad_out))
    names = ["out", "grad_x", "grad_weights", "grad_w_gate_up", "grad_w_down"]
    for got in others:
        errs = {n: rel(a, b) for n, a, b in zip(names, got, ref)}
        assert all(e < tol for e in errs.values()), errs
        for e in empty:
            assert torch.all(got[3][e] == 0) and torch.all(got[4][e] == 0)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_triton_grouped_gemm_matches_reference_with_empty_experts(dtype, tol, offsets_dtype):
    g = torch.Generator().manual_seed(7)
    E, K, M = 256, 136, 200
    counts = torch.randint(0, 40, (E,), generator=g)
    counts[::3] = 0
    offsets = torch.cumsum(counts, 0).to(offsets_dtype)  # int64 as torch.cumsum gives it: converted on entry
    N = int(counts.sum())
    x = torch.randn(N, K, generator=g, dtype=torch.float64)
    w = torch.randn(E, K, M, generator=g, dtype=torch.float64) / K**0.5
    gy = torch.randn(N, M, generator=g, dtype=torch.float64)
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = moe.grouped_gemm(ref_x, ref_w, offsets, backend="reference")
    ref.backward(gy)
    xx = x.to("cuda", dtype).requires_grad_()
    ww = w.to("cuda", dtype).requires_grad_()
    out = moe.grouped_gemm(xx, ww, offsets.cuda(), backend="triton")
    out.backward(gy.to("cuda", dtype))
    assert rel(out.double().cpu(), ref.detach()) < tol
    assert rel(xx.grad.double().cpu(), ref_x.grad) < tol
    assert rel(ww.grad.double().cpu(), ref_w.grad) < tol
    assert torch.all(ww.grad[::3] == 0)
    if dtype == torch.bfloat16:  # torch grouped_mm takes only int32 offsets: the entry converts them
        out_mm = moe.grouped_gemm(xx.detach(), ww.detach(), offsets.cuda(), backend="torch")
        assert rel(out_mm.double().cpu(), ref.detach()) < tol


def _block_configs():
    from moe_kernels.triton import grouped_gemm_kernels as gg

    return [("gemm", c) for c in gg._GEMM_CONFIGS_BF16] + [("swiglu", c) for c in gg._SWIGLU_CONFIGS_BF16] + [
        ("wgrad", c) for c in gg._WGRAD_CONFIGS_BF16
    ]


@pytest.mark.parametrize("kind,config", _block_configs(), ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_every_bf16_block_config_matches_reference(kind, config):
    """Each block shape the tuner may pick (pointer loads and tensor descriptors), forced, on
    experts of odd sizes with empty ones; every operand layout the block uses."""
    from moe_kernels.triton.grouped_gemm_kernels import grouped_gemm_launch, grouped_wgrad_launch

    g = torch.Generator().manual_seed(11)
    E, K, M, k, T = 12, 264, 200, 2, 450
    counts = torch.randint(1, 130, (E,), generator=g)
    counts[[2, 7]] = 0
    counts[-1] = T * k - int(counts[:-1].sum())
    assert counts[-1] > 0
    ends = torch.cumsum(counts, 0)
    offs = ends.to(torch.int32).cuda()
    spans = list(zip([0] + ends[:-1].tolist(), ends.tolist()))
    N = T * k
    sort_order = torch.randperm(N, generator=g)
    bf = lambda t: t.to("cuda", torch.bfloat16)  # noqa: E731
    x = bf(torch.randn(T, K, generator=g))
    xs = x.double()[sort_order.cuda() // k]
    if kind == "gemm":
        w = bf(torch.randn(E, K, M, generator=g) / K**0.5)
        wt = bf(torch.randn(E, M, K, generator=g) / K**0.5)  # B = wt^T, as in dgrad
        for b in (w, wt.transpose(1, 2)):
            c = grouped_gemm_launch(xs.bfloat16(), b, offs, out_cols=M, c=torch.empty(N, M, dtype=torch.bfloat16, device="cuda"), config=config)
            ref = torch.cat([xs[s:t] @ b[e].double() for e, (s, t) in enumerate(spans)])
            assert rel(c.double(), ref) < 1e-2
    elif kind == "swiglu":
        h = M // 2
        w1 = bf(torch.randn(E, K, 2 * h, generator=g) / K**0.5)
        pre = torch.empty(N, 2 * h, dtype=torch.bfloat16, device="cuda")
        act = torch.empty(N, h, dtype=torch.bfloat16, device="cuda")
        grouped_gemm_launch(x, w1, offs, out_cols=h, c=act, gather=sort_order.to("cuda", torch.int32), top_k=k,
                            epilogue=1, aux=pre, swiglu_h=h, config=config)
        ref_pre = torch.cat([xs[s:t] @ w1[e].double() for e, (s, t) in enumerate(spans)])
        gate, up = ref_pre.chunk(2, dim=1)
        assert rel(pre.double(), ref_pre) < 1e-2
        assert rel(act.double(), torch.nn.functional.silu(gate) * up) < 1e-2
        w2 = bf(torch.randn(E, h, K, generator=g) / h**0.5)
        dy = bf(torch.randn(N, K, generator=g))
        d_pre = torch.empty_like(pre)
        grouped_gemm_launch(dy, w2.transpose(1, 2), offs, out_cols=h, c=d_pre, epilogue=2, aux=pre, swiglu_h=h, config=config)
        d_act = torch.cat([dy.double()[s:t] @ w2[e].double().T for e, (s, t) in enumerate(spans)])
        gd, ud = pre.double().chunk(2, dim=1)
        sig = torch.sigmoid(gd)
        ref = torch.cat([d_act * ud * sig * (1 + gd * (1 - sig)), d_act * gd * sig], dim=1)
        assert rel(d_pre.double(), ref) < 1e-2
    else:
        dy = bf(torch.randn(N, M, generator=g))
        for gather in (None, sort_order.to("cuda", torch.int32)):
            a = xs.bfloat16() if gather is None else x
            dw = grouped_wgrad_launch(a, dy, offs, E, gather=gather, top_k=k, config=config)
            ref = torch.stack([xs[s:t].T @ dy.double()[s:t] for s, t in spans])
            assert rel(dw.double(), ref) < 1e-2
            assert torch.all(dw[[2, 7]] == 0)


@pytest.mark.parametrize("d", [72, 300, 513])  # wider than the combine backward's 256-column block (QA 150)
def test_triton_permute_combine_match_reference_and_are_deterministic(d):
    g = torch.Generator().manual_seed(3)
    T, E, k = 999, 64, 6
    ids = routing(T, E, k, (2, 9), g).cuda()
    rm = build_route_map(ids, E)
    x = torch.randn(T, d, generator=g).cuda().bfloat16()
    w = torch.rand(T, k, generator=g).cuda()
    y = torch.randn(T * k, d, generator=g).cuda().bfloat16()
    upstream = torch.randn(T, d, generator=g).cuda().bfloat16()  # column by column different: every chunk counts
    assert torch.equal(moe.permute(x, rm, backend="triton"), moe.permute(x, rm, backend="torch"))
    outs = []
    for _ in range(2):
        yy, ww = y.clone().requires_grad_(), w.clone().requires_grad_()
        out = moe.combine(yy, rm, ww, backend="triton")
        out.backward(upstream)
        outs.append((out, yy.grad, ww.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    yy, ww = y.float().requires_grad_(), w.clone().requires_grad_()
    ref = moe.combine(yy, rm, ww, backend="torch")
    ref.backward(upstream.float())
    assert rel(outs[0][0].float(), ref) < 1e-2
    assert rel(outs[0][1].float(), yy.grad) < 1e-2 and rel(outs[0][2], ww.grad) < 1e-2


def test_triton_moe_block_replays_in_cuda_graph():
    T, d, h, E, k = 517, 256, 128, 64, 4
    ids, leaves = problem(T, d, h, E, k, (5, 6), seed=11)
    dev = "cuda"
    static = [t.to(dev, torch.bfloat16).requires_grad_() for t in leaves]
    static[1] = leaves[1].to(dev, torch.float32).requires_grad_()
    static_ids = ids.to(dev)
    grad_out = torch.randn(T, d, device=dev, dtype=torch.bfloat16)

    def step():
        for t in static:
            t.grad = None
        rm = build_route_map(static_ids, E)
        out = moe_ffn(static[0], rm, static[1], static[2], static[3], backend="triton")
        out.backward(grad_out)
        return out

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up: compile and tune outside the capture
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    # fresh inputs and routing, then replay
    ids2, leaves2 = problem(T, d, h, E, k, (1,), seed=12)
    with torch.no_grad():
        static_ids.copy_(ids2)
        for t, new in zip(static, leaves2):
            t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    got = [static_out.detach().double().cpu()] + [t.grad.double().cpu() for t in static]
    rm_ref = build_route_map(ids2, E, backend="reference")
    ref = run_block(lambda x, w, a, b: moe_ffn(x, rm_ref, w, a, b, backend="reference"), leaves2, torch.float64, "cpu", grad_out.double().cpu())
    for a, b in zip(got, ref):
        assert rel(a, b) < 1.5e-2


def test_out_of_range_expert_id_trips_a_device_assert():
    """On the GPU the route map checks ids without a host read: a bad id fires a device-side
    assert. That ends the CUDA context, so it runs in a child process."""
    import subprocess
    import sys

    script = (
        "import torch, moe_kernels as moe\n"
        "ids = torch.randint(0, 8, (300, 2), device='cuda')\n"
        "ids[123, 1] = 8\n"
        "rm = moe.build_route_map(ids, 8, backend='triton')\n"
        "torch.cuda.synchronize()\n"
        "print('no assert')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no assert" not in proc.stdout, proc.stdout + proc.stderr
    assert "device-side assert" in proc.stderr or "assert" in proc.stderr.lower(), proc.stderr[-2000:]
    ok = subprocess.run([sys.executable, "-c", script.replace("ids[123, 1] = 8\n", "")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "no assert" in ok.stdout, ok.stderr[-2000:]


def test_auto_plan_timing_under_no_grad_inference_mode_and_activation_checkpointing():
    """auto times its plans the first time a shape is seen, with forward+backward passes of its own. That
    first call may come under no_grad (an eval before training), under inference_mode, or inside a
    torch.utils.checkpoint region (activation checkpointing), whose saved-tensor hooks must not rerun the
    caller's region for the timing's own backwards."""
    from moe_kernels import expert_ffn

    T, d, h, E, k = 515, 128, 96, 16, 2  # a shape no other test times
    ids, leaves = problem(T, d, h, E, k, (), seed=5)
    rm = build_route_map(ids.cuda(), E, backend="triton")
    x, w, a, b = (t.to("cuda", torch.bfloat16 if i != 1 else torch.float32) for i, t in enumerate(leaves))
    ref = moe_ffn(x, rm, w, a, b, backend="triton")

    def fresh():
        expert_ffn._PLANS.clear()

    fresh()
    with torch.inference_mode():
        assert torch.equal(moe_ffn(x, rm, w, a, b, backend="auto").float(), moe_ffn(x, rm, w, a, b, backend="triton").float())
    assert not expert_ffn._PLANS  # nothing timed or cached on inference tensors
    with torch.no_grad():
        out = moe_ffn(x, rm, w, a, b, backend="auto")
    assert expert_ffn._PLANS and rel(out.double().cpu(), ref.double().cpu()) < 1.5e-2

    fresh()
    runs = []

    def region(x, a, b):
        runs.append(1)
        return moe_ffn(x, rm, w, a, b, backend="auto")

    xs = [t.detach().clone().requires_grad_() for t in (x, a, b)]
    out = torch.utils.checkpoint.checkpoint(region, *xs, use_reentrant=False)
    assert expert_ffn._PLANS and len(runs) == 1
    out.float().sum().backward()
    assert len(runs) == 2  # the one recompute of backward, none for the timing's passes
    plain = [t.detach().clone().requires_grad_() for t in (x, a, b)]
    moe_ffn(plain[0], rm, w, plain[1], plain[2], backend="auto").float().sum().backward()
    for got, want in zip(xs, plain):
        assert rel(got.grad.double().cpu(), want.grad.double().cpu()) < 1.5e-2
