"""QA 98: moe-kernels' numbers against float64 truth, on shapes nobody picked (CPU).

The truth is the expert SwiGLU block written out from its definition in float64 (forward and a hand-written
backward), not through moe_kernels, and checked once against autograd of a dense einsum of the same definition.

Bounds, from first principles (u = unit roundoff: 2^-8 bf16, 2^-24 fp32; data rounded to u relative per store):
- block, well-conditioned random data, relative to the truth's norm (per tensor, and per expert for the weight
  gradients): bf16 4u. Each output is a short chain of stored roundings (out: pre, act, y, out; grad x: dy, d_act,
  d_pre, dx rows, grad x), each at most u and independent, with fp32 accumulation adding < n 2^-24; measured 1.0-1.2u.
  A reduction accumulated in bf16 over n rows errs ~u sqrt(n/6): 13u at n = 1024, so it fails. fp32: u (4 + sqrt(n)),
  n the longest reduction (fp32 accumulation's probabilistic bound); measured <= 6.2u.
- shape fuzz, where tiny sizes cancel: relative to the norm of the same sums over absolute values (every rounding is
  at most u of its operands' magnitudes): 4u (bf16), u (4 + sqrt(n)) (fp32); measured <= 1.0u / 1.6u.
- permute backward and combine (and its backward), elementwise: fp32 accumulation of at most 8 terms rounded once to
  the output dtype, so |err| <= half an ulp of the result + 2^-20 sum|terms| (the fp32 products and sums).
- Triton's interpreter truncates fp32 -> bf16 stores (FACTS.md): one-sided errors of up to a whole ulp, so its bf16
  bounds are doubled (8u, one ulp elementwise); measured 3.8u relative to the truth, 1.9u on the fuzz scale.

Determinism: combine is promised deterministic on every backend (its docstring), the route map and the Triton row
kernels everywhere (README); on the CPU every backend's route map, permute and combine (forward and backward) are
checked bitwise over repeated calls and torch.set_num_threads(1) against (2). The Triton kernels run under the interpreter in a
subprocess (`interpreter_checks`); test_qa98_gpu.py runs the same checks on CUDA.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch

import moe_kernels as moe

sys.path.insert(0, str(Path(__file__).parent))
import interpreter_checks  # noqa: E402

try:
    import numpy  # noqa: F401  (Triton's interpreter runs on numpy)
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

BF16, FP32 = torch.bfloat16, torch.float32
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
NAMES = ("out", "grad_x", "grad_weights", "grad_w_gate_up", "grad_w_down")


# ---------------------------------------------------------------- float64 truth, from the definition


def _silu_parts(g: torch.Tensor):
    s = torch.sigmoid(g)
    return g * s, s * (1 + g * (1 - s)), s * (1 - s) * (2 + g * (1 - 2 * s))  # silu, silu', silu''


def block_truth(x, w, ids, w1, w2, grad_out, absolute: bool = False) -> list[torch.Tensor]:
    """out[t] = sum_s w[t,s] (silu(x[t] W1_e[:, :h]) * x[t] W1_e[:, h:]) W2_e, e = ids[t,s], and its gradients
    (x, w, W1, W2) for dL/dout = grad_out, in float64 on x's device: [out, gx, gw, gW1, gW2].
    absolute=True: the same sums over absolute values of every factor (and of the nonlinearity's sensitivity), the
    magnitude every rounding error is measured against."""
    f = (lambda t: t.abs()) if absolute else (lambda t: t)
    x, w, w1, w2, grad_out = (f(t.detach().double()) for t in (x, w, w1, w2, grad_out))
    T, k = ids.shape
    h = w2.shape[1]
    out, gx = torch.zeros_like(grad_out), torch.zeros_like(x)
    gw = torch.zeros(T * k, dtype=torch.float64, device=x.device)
    gw1, gw2 = torch.zeros_like(w1), torch.zeros_like(w2)
    token = torch.arange(T, device=x.device).repeat_interleave(k)
    flat_ids, flat_w = ids.reshape(-1).to(x.device).long(), w.reshape(-1)
    order = torch.sort(flat_ids, stable=True).indices
    counts = torch.bincount(flat_ids, minlength=w1.shape[0]).tolist()
    for e, rows in enumerate(torch.split(order, counts)):
        if rows.numel() == 0:
            continue
        xe, we, ge = x[token[rows]], flat_w[rows, None], grad_out[token[rows]]
        pre = xe @ w1[e]
        gate, up = pre[:, :h], pre[:, h:]
        silu, d_silu, d2_silu = _silu_parts(gate)
        if absolute:  # an error in gate moves silu by silu' times it: keep the larger magnitude
            silu, d_silu, up = silu.abs() + (d_silu * gate).abs(), d_silu.abs() + (d2_silu * gate).abs(), up.abs()
        act = silu * up
        y = act @ w2[e]
        out.index_add_(0, token[rows], we * y)
        dy = we * ge
        gw[rows] = (ge * y).sum(1)
        d_act = dy @ w2[e].T
        gw2[e] = act.T @ dy
        d_pre = torch.cat([d_act * up * d_silu, d_act * silu], 1)
        gw1[e] = xe.T @ d_pre
        gx.index_add_(0, token[rows], d_pre @ w1[e].T)
    return [out, gx, gw.view(T, k), gw1, gw2]


def truth_by_autograd(x, w, ids, w1, w2, grad_out) -> list[torch.Tensor]:
    """The same definition as one dense einsum, differentiated by autograd (to check block_truth itself)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, w1, w2)]
    x, w, w1, w2 = leaves
    gate, up = torch.einsum("td,tkdn->tkn", x, w1[ids]).chunk(2, dim=-1)
    out = (torch.einsum("tkh,tkhd->tkd", torch.nn.functional.silu(gate) * up, w2[ids]) * w[..., None]).sum(1)
    out.backward(grad_out.double())
    return [out.detach()] + [t.grad for t in leaves]


# ---------------------------------------------------------------- problems


def routing(T: int, E: int, k: int, mode: str, g: torch.Generator) -> torch.Tensor:
    """[T, k] ids: distinct top-k, top-k over half the experts (the rest empty), every row on one expert, or
    independent draws (a token may pick an expert twice, and k may exceed E). On the generator's device."""
    dev = g.device
    if mode == "topk":
        return torch.rand(T, E, generator=g, device=dev).topk(k, dim=1).indices
    if mode == "empty":
        allowed = torch.randperm(E, generator=g, device=dev)[: max(k, E // 2)]
        return allowed[torch.rand(T, len(allowed), generator=g, device=dev).topk(k, dim=1).indices]
    if mode == "one_expert":
        return torch.full((T, k), int(torch.randint(0, E, (1,), generator=g, device=dev)), device=dev)
    return torch.randint(0, E, (T, k), generator=g, device=dev)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous: every other column of a wider tensor ([T, n]), or w[e] stored transposed."""
    if t.dim() == 2:
        wide = torch.zeros(t.shape[0], 2 * t.shape[1] + 1, dtype=t.dtype, device=t.device)
        wide[:, 1::2] = t
        return wide[:, 1::2]
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def problem(T, d, h, E, k, dtype, w_dtype=torch.float32, mode="topk", seed=0, scale=1.0, noncontig=False, device="cpu"):
    """(ids, [x, weights, w_gate_up, w_down], grad_out): random data made on device (fp32, then cast)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = routing(T, E, k, mode, g)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    leaves = [
        randn(T, d) * scale,
        torch.rand(T, k, generator=g, device=device),
        randn(E, d, 2 * h) / max(d, 1) ** 0.5,
        randn(E, h, d) / max(h, 1) ** 0.5,
    ]
    leaves = [t.to(w_dtype if i == 1 else dtype) for i, t in enumerate(leaves)]
    grad_out = randn(T, d).to(dtype)
    if noncontig:
        leaves, grad_out = [strided(t) for t in leaves], strided(grad_out)
    return ids, leaves, grad_out


def run_block(fn, leaves, grad_out) -> list[torch.Tensor]:
    """[out, grad x, grad weights, grad w_gate_up, grad w_down] of fn(x, weights, w_gate_up, w_down)."""
    xs = [t.detach().requires_grad_() for t in leaves]
    out = fn(*xs)
    out.backward(grad_out)
    return [out.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in xs]


def fused(rm, backend):
    return lambda x, w, a, b: moe.moe_ffn(x, rm, w, a, b, backend=backend)


def composed(rm, backend):
    """combine(swiglu_experts(permute(x))): the unfused ops (row ops on auto where backend is torch, GEMM-only)."""
    rows = "auto" if backend == "torch" else backend
    return lambda x, w, a, b: moe.combine(
        moe.swiglu_experts(moe.permute(x, rm, backend=rows), a, b, rm.offsets, backend=backend), rm, w, backend=rows
    )


def longest_reduction(T, d, h, E, k, ids) -> int:
    per_expert = int(torch.bincount(ids.reshape(-1).cpu(), minlength=E).max()) if ids.numel() else 0
    return max(d, 2 * h, k, per_expert, 1)


def accuracy_bound(dtype, n, interpreter=False) -> float:
    u = UNIT_ROUNDOFF[dtype]
    if dtype == torch.float32:
        return u * (4 + math.sqrt(n))
    return (8 if interpreter else 4) * u


def relative_errors(got, truth) -> dict[str, float]:
    """||got - truth|| / ||truth|| per tensor, and per expert (worst) for the weight gradients."""
    errs = {n: ((a.double() - t).norm() / t.norm()).item() for n, a, t in zip(NAMES, got, truth)}
    for n, a, t in zip(NAMES[3:], got[3:], truth[3:]):
        norms = t.flatten(1).norm(dim=1)
        used = norms > 0
        errs[n + "_per_expert"] = ((a.double() - t).flatten(1).norm(dim=1)[used] / norms[used]).max().item()
    return errs


def scaled_errors(got, truth, scale) -> list[float]:
    """||got - truth|| / ||scale||, scale the absolute-value truth (0 where got is exact)."""
    out = []
    for a, t, s in zip(got, truth, scale):
        err = (a.double() - t).norm().item()
        out.append(err / s.norm().item() if err else 0.0)
    return out


def check_block_accuracy(T, d, h, E, k, dtype, backends, seed=0, device="cpu", interpreter=False,
                         hows=("fused", "composed")) -> dict:
    """Every backend's block (fused and composed) against the float64 truth, relative to the truth's norm."""
    ids, leaves, grad_out = problem(T, d, h, E, k, dtype, seed=seed, device=device)
    truth = block_truth(leaves[0], leaves[1], ids, leaves[2], leaves[3], grad_out)
    rm = moe.build_route_map(ids, E)
    bound = accuracy_bound(dtype, longest_reduction(T, d, h, E, k, ids), interpreter)
    measured = {}
    for backend in backends:
        for how, make in ((how, {"fused": fused, "composed": composed}[how]) for how in hows):
            errs = relative_errors(run_block(make(rm, backend), leaves, grad_out), truth)
            measured[f"{backend}/{how}"] = errs
            assert max(errs.values()) < bound, (backend, how, dtype, {n: e / UNIT_ROUNDOFF[dtype] for n, e in errs.items()})
    return measured


# ---------------------------------------------------------------- permute / combine, elementwise


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of dtype's numbers at |t| (t float64; subnormals floored at the smallest normal's spacing)."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    tiny = torch.finfo(dtype).tiny
    return torch.pow(2.0, torch.floor(torch.log2(t.abs().clamp_min(tiny))) - (bits - 1))


def ulps_over(got: torch.Tensor, truth: torch.Tensor, terms_abs: torch.Tensor, dtype: torch.dtype) -> float:
    """max |got - truth| / (ulp(result) + 2^-19 sum|terms|): <= 0.5 when rounded once from an fp32 sum of <= 8
    terms (the fp32 products and additions err < 2^-20 sum|terms|)."""
    err = (got.double() - truth).abs()
    mag = torch.maximum(truth.abs(), got.double().abs())
    return (err / (ulp(mag, dtype) + 2.0**-19 * terms_abs)).max().item()


ROW_CHECKS = ("permute_backward", "combine", "combine_backward_dy", "combine_backward_gw")


def check_row_ops(backend, dtype, w_dtype, T=600, d=72, E=16, k=8, seed=1, half_ulps=0.5, device="cpu",
                  checked=ROW_CHECKS) -> dict:
    """permute forward exact; permute backward (sum of k rows), combine forward (weighted sum of k rows) and
    backward (dy = w g, gw = <g, y>) each rounded once from fp32 (those in `checked`)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, normal=True):
        return (torch.randn(*shape, generator=g) if normal else torch.rand(*shape, generator=g)).to(device)

    rm = moe.build_route_map(rand(T, E).topk(k, dim=1).indices, E)
    x = rand(T, d).to(dtype).requires_grad_()
    rows = moe.permute(x, rm, backend=backend)
    assert torch.equal(rows, x.detach()[rm.source_token])
    g_rows = (rand(T * k, d) * rand(T * k, 1, normal=False) * 4).to(dtype)
    rows.backward(g_rows)
    by_token = g_rows.double()[rm.dest_row].view(T, k, d)
    over = {"permute_backward": ulps_over(x.grad, by_token.sum(1), by_token.abs().sum(1), dtype)}
    y = rand(T * k, d).to(dtype).requires_grad_()
    w = rand(T, k, normal=False).to(w_dtype).requires_grad_()
    out = moe.combine(y, rm, w, backend=backend)
    assert out.dtype == dtype
    terms = y.detach().double()[rm.dest_row].view(T, k, d) * w.detach().double()[..., None]
    over["combine"] = ulps_over(out, terms.sum(1), terms.abs().sum(1), dtype)
    grad = rand(T, d).to(dtype)
    out.backward(grad)
    dy = (grad.double()[:, None, :] * w.detach().double()[..., None]).reshape(T * k, d)[rm.sort_order]
    over["combine_backward_dy"] = ulps_over(y.grad, dy, dy.abs(), dtype)
    products = grad.double()[:, None, :] * y.detach().double()[rm.dest_row].view(T, k, d)
    # gw sums d products: fp32 accumulation errs <= d 2^-24 sum|products| (the deterministic bound); ulps_over
    # allows half its terms argument times 2^-19, so pass twice that bound over 2^-19
    gw_slack = 2 * d * 2.0**-24 / 2.0**-19 * products.abs().sum(-1)
    over["combine_backward_gw"] = ulps_over(w.grad, products.sum(-1), gw_slack, w_dtype)
    assert all(over[name] <= half_ulps for name in checked), (backend, dtype, w_dtype, over)
    return over


# ---------------------------------------------------------------- shape fuzz


PRIMES = (2, 3, 5, 7, 13, 31, 61, 97, 127, 257, 521)


def fuzz_case(seed: int, small: bool = False) -> dict:
    """A random problem: T in 0, 1, primes; d, h odd, tiny, no multiple of 16 (sometimes 0); E 1, 2, odd or 256;
    k up to min(E, 8) (up to 8 with repeated experts); routing with empty experts or all rows on one expert;
    strided inputs; bf16 or fp32 rows, fp32 or same-dtype router weights; scales far from 1."""
    r = random.Random(seed)
    mode = r.choice(["topk", "empty", "one_expert", "repeats"])
    E = r.choice([1, 2, 3, 5, 7, 13] if small else [1, 2, 3, 5, 7, 13, 256])  # (the interpreter runs a wgrad
    # program per expert: E=256 costs seconds there, and runs on the CPU paths and on the GPU)
    case = {
        "T": r.choice([0, 1, 2, 3, 5, 13, 31] if small else [0, 1, *PRIMES, r.randint(1, 700)]),
        "d": r.choice([1, 3, 5, 8, 13, 24, 33] if small else [1, 2, 3, 5, 7, 8, 12, 13, 17, 24, 33, 40, 63, 100]),
        "h": r.choice([1, 2, 3, 7, 12, 17] if small else [1, 2, 3, 4, 5, 7, 9, 12, 17, 36, 72]),
        "E": E, "k": r.randint(1, min(E, 8) if mode in ("topk", "empty") else 8), "mode": mode,
        "dtype": r.choice([BF16, FP32]), "scale": r.choice([1.0, 1.0, 1e-3, 30.0]), "noncontig": r.random() < 0.5,
        "seed": seed,
    }
    case["w_dtype"] = r.choice([FP32, case["dtype"]])
    if not small and r.random() < 0.05:
        case["d"] = 0
    if not small and r.random() < 0.05:
        case["h"] = 0
    return case


def check_fuzz_case(case: dict, backends, device="cpu", interpreter=False) -> dict:
    """Every backend (fused and composed) against the float64 truth and against the reference, on the scale of the
    absolute-value sums. A backend that refuses must be torch (grouped_mm's dtype / alignment), with a ValueError."""
    c = dict(case)
    ids, leaves, grad_out = problem(c["T"], c["d"], c["h"], c["E"], c["k"], c["dtype"], c["w_dtype"], c["mode"],
                                    c["seed"], c["scale"], c["noncontig"], device)
    truth = block_truth(leaves[0], leaves[1], ids, leaves[2], leaves[3], grad_out)
    scale = block_truth(leaves[0], leaves[1], ids, leaves[2], leaves[3], grad_out, absolute=True)
    rm = moe.build_route_map(ids, c["E"])
    n = longest_reduction(c["T"], c["d"], c["h"], c["E"], c["k"], ids)
    bound = accuracy_bound(c["dtype"], n, interpreter)
    ref = run_block(fused(rm, "reference"), leaves, grad_out)
    ref_bound = accuracy_bound(c["dtype"], n)
    measured = {}
    for backend in backends:
        for how, make in (("fused", fused), ("composed", composed)):
            try:
                got = run_block(make(rm, backend), leaves, grad_out)
            except ValueError as e:
                assert backend == "torch" and "grouped_mm" in str(e), (case, backend, how, e)
                continue
            for name, a in zip(NAMES, got):
                assert a.shape == truth[NAMES.index(name)].shape and a.dtype in (c["dtype"], c["w_dtype"]), (case, name)
            errs = scaled_errors(got, truth, scale)
            vs_ref = scaled_errors(got, [t.double() for t in ref], scale)
            measured[f"{backend}/{how}"] = max(errs) / UNIT_ROUNDOFF[c["dtype"]]
            assert max(errs) < bound and max(vs_ref) < bound + ref_bound, (case, backend, how, errs, vs_ref)
    return measured


# ---------------------------------------------------------------- CPU tests


def test_float64_truth_is_autograd_of_the_definition():
    ids, leaves, grad_out = problem(37, 11, 6, 5, 3, torch.float64, torch.float64, mode="repeats", seed=3)
    for a, b in zip(block_truth(leaves[0], leaves[1], ids, leaves[2], leaves[3], grad_out),
                    truth_by_autograd(leaves[0], leaves[1], ids, leaves[2], leaves[3], grad_out)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# top-8 sums over 1024 rows per expert; 8192 rows in one expert's wgrad (bf16: where accumulation would show)
@pytest.mark.parametrize("dtype,T,E,k", [(BF16, 1024, 8, 8), (BF16, 8192, 1, 1), (FP32, 1024, 8, 8)])
def test_block_outputs_and_every_gradient_match_float64_truth(dtype, T, E, k):
    backends = ("reference", "auto") + (("torch",) if dtype == FP32 else ())
    check_block_accuracy(T, 64, 32, E, k, dtype, backends)


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
@pytest.mark.parametrize("dtype,w_dtype", [(BF16, FP32), (BF16, BF16), (FP32, FP32)])
def test_permute_backward_and_combine_round_once_from_fp32(backend, dtype, w_dtype):
    check_row_ops(backend, dtype, w_dtype)


def _route_permute_combine(backend, dtype, T=2003, d=136, E=16, k=6, device="cpu"):
    """[counts, offsets, sort_order, dest_row, rows, combined, grad x, grad weights] of one permute + combine."""
    g = torch.Generator().manual_seed(5)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(device)
    rm = moe.build_route_map(ids, E, backend="torch" if backend == "reference" else backend)
    x = torch.randn(T, d, generator=g).to(device, dtype).requires_grad_()
    w = torch.rand(T, k, generator=g).to(device).requires_grad_()
    rows = moe.permute(x, rm, backend=backend)
    out = moe.combine(rows * 1.5, rm, w, backend=backend)
    out.backward(torch.randn(T, d, generator=g).to(device, dtype))
    return [rm.counts, rm.offsets, rm.sort_order, rm.dest_row, rows, out, x.grad, w.grad]


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_route_map_permute_combine_bitwise_repeatable_across_calls_and_thread_counts(backend, dtype):
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (2, 1, 2):
            torch.set_num_threads(threads)
            results.append(_route_permute_combine(backend, dtype))
    finally:
        torch.set_num_threads(saved)
    for other in results[1:]:
        for name, a, b in zip(("counts", "offsets", "sort_order", "dest_row", "rows", "combine", "grad_x", "grad_w"),
                              results[0], other):
            assert torch.equal(a, b), name


FUZZ_SEEDS = range(9800, 9845)


def test_shape_fuzz_every_cpu_backend_against_float64_and_reference():
    for seed in FUZZ_SEEDS:
        check_fuzz_case(fuzz_case(seed), ("reference", "auto", "torch"))


# ---------------------------------------------------------------- the Triton kernels under the interpreter


def interp_block_accuracy(torch_, moe_):
    check_block_accuracy(128, 64, 32, 1, 1, FP32, ("triton",), interpreter=True)  # two M tiles, two wgrad chunks
    check_block_accuracy(32, 24, 40, 4, 4, BF16, ("triton",), interpreter=True)


def interp_row_ops(torch_, moe_):
    check_row_ops("triton", FP32, FP32, T=64, d=40)
    check_row_ops("triton", BF16, BF16, T=64, d=40, half_ulps=1.0)  # the interpreter truncates to bf16: one ulp


def interp_repeatable(torch_, moe_):
    first = _route_permute_combine("triton", FP32, T=61, d=40)
    torch.set_num_threads(1)
    try:
        again = _route_permute_combine("triton", FP32, T=61, d=40)
    finally:
        torch.set_num_threads(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def interp_shape_fuzz(torch_, moe_):
    for seed in range(9900, 9904):
        check_fuzz_case(fuzz_case(seed, small=True), ("triton",), interpreter=True)
    # several M, N and K tiles and a partial wgrad chunk in each expert (the CPU blocks are 64)
    case = {"T": 130, "d": 100, "h": 72, "E": 1, "k": 1, "mode": "topk", "dtype": FP32, "w_dtype": FP32, "scale": 1.0,
            "noncontig": True, "seed": 1}
    check_fuzz_case(case, ("triton",), interpreter=True)


CHECKS = {f.__name__: f for f in (interp_block_accuracy, interp_row_ops, interp_repeatable, interp_shape_fuzz)}


@pytest.mark.skipif(not HAVE_TRITON, reason="triton or numpy (its interpreter needs it) is not installed")
@pytest.mark.parametrize("check", list(CHECKS))
def test_triton_kernels_under_interpreter_match_float64_truth(interpreter_verdicts, check):
    assert interpreter_verdicts[check]["verdict"] == "ok", interpreter_verdicts[check]["verdict"]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        CHECKS = {name: CHECKS[name] for name in sys.argv[1:]}
    interpreter_checks.run_checks(CHECKS, torch, moe)
