"""QA 152 (review helper 170, an attack on the public API from another training stack, on the CPU):
1. An expand()ed expert weight (a stride of 0 in its last two dims) passed grouped_mm's layout test (0 is a multiple
   of 16 bytes): backend="auto" crashed in torch's grouped_mm ("Invalid strides/sizes") instead of taking the
   reference loop, backend="torch" raised torch's RuntimeError instead of the ValueError naming the layout, and a
   block whose w_down alone was expanded ran its first GEMM before failing.
2. grouped_gemm and grouped_gemm_reference took integer and complex operands: uint8 computed in uint8 and wrapped
   (200 * 200 * 8 gave 0); swiglu_experts and combine refused them.
3. README: on the CPU `auto` runs the reference loop for anything but fp32 with 16-byte rows, so a bf16 block compiles
   with its graph broken at the GEMMs (it said every backend but `reference` traced whole on the CPU). The broken
   graph still gives eager's numbers (checked here); fullgraph=True fails in dynamo, as the README now says."""

from __future__ import annotations

import pytest
import torch

from moe_kernels import build_route_map, grouped_gemm, grouped_gemm_reference, moe_ffn

E, K, M = 4, 16, 8
OFFSETS = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 empty


def _expanded(layout: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(152)
    if layout == "stride 0 in M":
        return torch.randn(E, K, 1, generator=g).expand(E, K, M)
    if layout == "stride 0 in K":
        return torch.randn(E, 1, M, generator=g).expand(E, K, M)
    return torch.randn(E, M, 1, generator=g).expand(E, M, K).transpose(1, 2)  # column-major, stride 0 in M


@pytest.mark.parametrize("layout", ["stride 0 in M", "stride 0 in K", "column-major stride 0"])
def test_an_expanded_weight_runs_on_auto_and_is_refused_by_name_on_torch(layout):
    w = _expanded(layout)
    x = torch.randn(10, K, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want = grouped_gemm_reference(x, w.contiguous(), OFFSETS)
    got = grouped_gemm(x, w, OFFSETS, backend="auto")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"torch grouped_mm does not support .* \(strides \(.*0.*\)\).* at least "
                                         r"that dim's size \(an expand\(\)ed w, stride 0, has not: w.contiguous\(\) "
                                         r"has\)"):  # the rule it breaks (helper 172: the message listed only others)
        grouped_gemm(x, w, OFFSETS, backend="torch")


def test_a_block_with_only_w_down_expanded_is_refused_on_torch_before_its_first_gemm(monkeypatch):
    T, d, h, k = 6, 16, 8, 2
    g = torch.Generator().manual_seed(2)
    rm = build_route_map(torch.randint(0, E, (T, k), generator=g), E)
    x, weights = torch.randn(T, d, generator=g), torch.rand(T, k, generator=g)
    w_gate_up, w_down = torch.randn(E, d, 2 * h, generator=g), torch.randn(E, h, 1, generator=g).expand(E, h, d)
    ran = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    with pytest.raises(ValueError, match="torch grouped_mm does not support"):
        moe_ffn(x, rm, weights, w_gate_up, w_down, backend="torch")
    assert not ran, "the first GEMM ran before the refusal"
    want = moe_ffn(x, rm, weights, w_gate_up, w_down.contiguous(), backend="reference")
    torch.testing.assert_close(moe_ffn(x, rm, weights, w_gate_up, w_down, backend="auto"), want)


DTYPES = [torch.uint8, torch.int32, torch.int64, torch.complex64, torch.bool]
DTYPES += [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gemm", [grouped_gemm, grouped_gemm_reference], ids=["grouped_gemm", "reference"])
def test_grouped_gemm_refuses_operands_it_cannot_compute_in_naming_the_dtype(gemm, dtype):
    x = torch.ones(10, K).to(dtype)
    w = torch.ones(E, K, M).to(dtype)
    with pytest.raises(ValueError, match=rf"x and w are {dtype}: the grouped GEMM computes in torch.float16, "
                                         r"torch.bfloat16, torch.float32, torch.float64; cast both"):
        gemm(x, w, OFFSETS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_cpu_block_auto_takes_to_the_reference_loop_compiles_with_a_broken_graph_to_eagers_numbers(dtype):
    T, d, h, k = 9, 16, 8, 2
    g = torch.Generator().manual_seed(3)
    w1 = (torch.randn(E, d, 2 * h, generator=g) / 4).to(dtype)
    w2 = (torch.randn(E, h, d, generator=g) / 3).to(dtype)
    x, logits = torch.randn(T, d, generator=g).to(dtype), torch.randn(T, E, generator=g)

    def block(x, logits):  # noqa: ANN001, ANN202
        weights, ids = logits.softmax(-1).topk(k, -1)
        return moe_ffn(x, build_route_map(ids, E), weights, w1, w2, backend="auto")

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(block, backend="aot_eager")(x, logits), block(x, logits), rtol=0, atol=0)
