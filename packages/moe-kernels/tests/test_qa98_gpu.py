"""QA 98 on CUDA: the triton, torch and auto backends against float64 truth, on realistic and awkward shapes.

The same checks as test_qa98.py (its float64 truth, bounds and fuzz cases), on the GPU: the block's output and all
four gradients relative to the truth (bf16 4u, fp32 u (4 + sqrt(n)); u = 2^-8 / 2^-24), per expert for the weight
gradients; permute's backward and combine rounded once from fp32 (half an ulp); route map, permute and combine
bitwise repeatable; a shape fuzz of every backend against the truth and the reference. The truth runs on the GPU
in float64. To stay near a minute on one H100, each kernel runs one block shape per tuning key (chosen per key
by a seeded draw, so different keys exercise different shapes, the Gluon wgrad among them; test_triton_gpu.py
forces every shape) and auto's plan search times one round; in the fuzz, auto's plan is a seeded random
GEMM-by-GEMM mix of Triton and grouped_mm (the real search runs in the shape tests).

Run on the device: PYTHONPATH=packages/moe-kernels/src python3 -m pytest -m gpu -s packages/moe-kernels/tests/test_qa98_gpu.py
(-s prints the measured errors, in units of u, and each part's seconds).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import moe_kernels as moe

sys.path.insert(0, str(Path(__file__).parent))
import test_qa98 as qa  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
BACKENDS = ("triton", "torch", "auto")
# (T, d, h, E, k, dtype, backends, hows): the benchmark's shape (a) with E=256 and a prime T; an awkward one whose
# rows grouped_mm cannot take (torch refuses it, auto runs Triton); 16k rows per expert (long wgrad reductions);
# fp32 (Triton only: grouped_mm on CUDA is bf16)
SHAPES = [
    (16381, 2048, 1024, 256, 8, qa.BF16, BACKENDS, ("fused",)),
    (16381, 100, 72, 256, 8, qa.BF16, BACKENDS, ("fused", "composed")),
    (16381, 512, 256, 2, 2, qa.BF16, BACKENDS, ("fused",)),
    (4093, 100, 72, 16, 4, qa.FP32, ("triton", "auto"), ("fused", "composed")),
]
ROW_OPS = {"T": 16381, "d": 512, "E": 256, "k": 8}
FUZZ_SECONDS, FUZZ_MIN_CASES = 15.0, 5
LARGE_T = (2039, 8191, 16381)  # every third fuzz case (the CPU fuzz stays under 700 tokens)


def grouped_mm_runs(dtype, d: int, h: int) -> bool:
    """Whether torch's CUDA grouped_mm takes the block: bf16, rows of 16-byte multiples (d, 2h, h)."""
    return dtype == qa.BF16 and d % 8 == 0 and h % 8 == 0


@pytest.fixture
def one_block_shape_per_key(monkeypatch):
    """Each tuning key runs one block shape, drawn per key (a candidate that does not build is skipped, as the
    tuner skips it), and auto's plan search times one round; fp32 matmuls stay IEEE (combine's torch path)."""
    from moe_kernels import expert_ffn
    from moe_kernels.triton import grouped_gemm_kernels, tuning

    def pick(key, configs, launch):
        best = tuning._BEST.get(key)
        if best is None:
            order = random.Random(repr(key)).sample(range(len(configs)), len(configs))
            for i in order:
                try:
                    launch(configs[i])
                except Exception as exc:
                    if not tuning._unbuildable(exc):
                        raise
                    continue
                tuning._BEST[key] = configs[i]
                return configs[i]
            raise AssertionError(f"no block shape builds for {key}")
        launch(best)
        return best

    monkeypatch.setattr(grouped_gemm_kernels, "pick_config", pick)
    monkeypatch.setattr(expert_ffn, "_PLAN_ROUNDS", 1)
    saved_best, saved_plans, saved_tf32 = dict(tuning._BEST), dict(expert_ffn._PLANS), torch.backends.cuda.matmul.allow_tf32
    tuning._BEST.clear()
    expert_ffn._PLANS.clear()
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    tuning._BEST.clear()
    tuning._BEST.update(saved_best)
    expert_ffn._PLANS.clear()
    expert_ffn._PLANS.update(saved_plans)


@pytest.fixture
def random_auto_plans(monkeypatch, one_block_shape_per_key):
    """auto's plan per shape key: a seeded random BlockPlan instead of the timed search."""
    from moe_kernels import expert_ffn
    from moe_kernels.triton.ffn_kernels import PLAN_OPTIONS, BlockPlan

    def plan(x, w_gate_up, w_down, offsets, routing, key=None):
        r = random.Random(repr(key))
        return BlockPlan(**{f.name: r.choice(PLAN_OPTIONS[f.name]) for f in fields(BlockPlan)})

    monkeypatch.setattr(expert_ffn, "_time_plans", plan)


def _in_u(errs: dict, dtype) -> dict:
    return {n: round(e / qa.UNIT_ROUNDOFF[dtype], 2) for n, e in errs.items()}


@pytest.mark.parametrize("T,d,h,E,k,dtype,backends,hows", SHAPES, ids=lambda v: str(v).replace("torch.", ""))
def test_gpu_block_outputs_and_every_gradient_match_float64_truth(one_block_shape_per_key, T, d, h, E, k, dtype,
                                                                  backends, hows):
    start = time.perf_counter()
    runnable = []
    for backend in backends:
        if backend == "torch" and not grouped_mm_runs(dtype, d, h):
            ids, leaves, grad_out = qa.problem(8, d, h, E, k, dtype, device=DEVICE)
            with pytest.raises(ValueError, match="grouped_mm"):  # refused by name, before any GEMM
                qa.run_block(qa.fused(moe.build_route_map(ids, E), "torch"), leaves, grad_out)
            continue
        runnable.append(backend)
    measured = qa.check_block_accuracy(T, d, h, E, k, dtype, tuple(runnable), device=DEVICE, hows=hows)
    for name, errs in measured.items():
        print(f"[qa98 gpu] T={T} d={d} h={h} E={E} k={k} {dtype} {name}: {_in_u(errs, dtype)} u")
    print(f"[qa98 gpu] shape done in {time.perf_counter() - start:.1f} s")


ROW_DTYPES = [(qa.BF16, qa.FP32), (qa.BF16, qa.BF16), (qa.FP32, qa.FP32)]
ROW_NAMES = ("counts", "offsets", "sort_order", "dest_row", "rows", "combine", "grad_x", "grad_w")


@pytest.mark.parametrize("backend", ["triton", "auto", "torch", "reference"])
@pytest.mark.parametrize("dtype,w_dtype", ROW_DTYPES)
def test_gpu_combine_and_triton_permute_backward_round_once_from_fp32(one_block_shape_per_key, backend, dtype, w_dtype):
    """combine accumulates in fp32 on every backend (README, docstring); so do the Triton row kernels (permute's
    backward too, on triton and auto)."""
    checked = qa.ROW_CHECKS if backend in ("triton", "auto") else qa.ROW_CHECKS[1:]
    over = qa.check_row_ops(backend, dtype, w_dtype, device=DEVICE, checked=checked, **ROW_OPS)
    print(f"[qa98 gpu] row ops {backend} {dtype}/{w_dtype}: { {n: round(v, 3) for n, v in over.items()} } "
          "(error in ulps of the result; bound 0.5)")


@pytest.mark.parametrize("backend", ["triton", "auto", "torch", "reference"])
@pytest.mark.parametrize("dtype", [qa.BF16, qa.FP32])
def test_gpu_route_map_combine_and_triton_permute_bitwise_repeatable(backend, dtype):
    """combine is deterministic on every backend (its docstring), the Triton route-map and row kernels wherever
    they run (README); permute's backward on torch / reference is checked in the next test."""
    args = {**ROW_OPS, "device": DEVICE}
    first, again = (qa._route_permute_combine(backend, dtype, **args) for _ in range(2))
    for name, a, b in zip(ROW_NAMES, first, again):
        if name != "grad_x" or backend in ("triton", "auto"):
            assert torch.equal(a, b), (backend, name)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_gpu_permute_backward_on_torch_paths_sums_top_k_in_fp32_and_repeats(backend):
    """permute(backend="torch" / "reference") was x.index_select(0, source_token): autograd's backward is index_add_,
    which on CUDA adds with atomics in the gradient's dtype (PyTorch lists it as nondeterministic there): a bf16 sum
    over top-k, k-1 extra roundings in an order that changes run to run. Now it gathers x repeated k times by
    sort_order (each row added once into its own slot, the k slots summed in fp32), as the triton kernels do."""
    over = qa.check_row_ops(backend, qa.BF16, qa.FP32, device=DEVICE, checked=("permute_backward",), **ROW_OPS)
    print(f"[qa98 gpu] permute backward {backend} bf16: {over['permute_backward']:.3f} ulps (bound 0.5)")
    args = {**ROW_OPS, "device": DEVICE}
    first, again = (qa._route_permute_combine(backend, qa.BF16, **args) for _ in range(2))
    assert torch.equal(first[ROW_NAMES.index("grad_x")], again[ROW_NAMES.index("grad_x")])


def test_gpu_shape_fuzz_every_backend_against_float64_and_reference(random_auto_plans):
    """Random shapes (T 0, 1, primes; d, h odd, tiny, off every block; E 1, 2, odd, 256; repeated experts, empty
    experts, one expert; strided inputs; bf16 and fp32) for FUZZ_SECONDS, at least FUZZ_MIN_CASES of them."""
    start, done, worst = time.perf_counter(), 0, {}
    seed = 98000
    while done < FUZZ_MIN_CASES or time.perf_counter() - start < FUZZ_SECONDS:
        case = qa.fuzz_case(seed)
        if seed % 3 == 0:
            case["T"] = random.Random(seed).choice(LARGE_T)
        measured = qa.check_fuzz_case(case, BACKENDS, device=DEVICE)
        for name, value in measured.items():
            key = (name, str(case["dtype"]))
            worst[key] = max(worst.get(key, 0.0), value)
        seed, done = seed + 1, done + 1
    print(f"[qa98 gpu] fuzz: {done} cases in {time.perf_counter() - start:.1f} s; worst error on the |.|-scale, in u: "
          f"{ {k: round(v, 2) for k, v in sorted(worst.items())} }")
