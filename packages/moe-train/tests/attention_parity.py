"""FlexAttention against scaled_dot_product_attention on a GPU, one parameter at a time, for the GPU tests of
train.document_masking and model.sliding_window_pattern.

In fp32 the two kernels must agree to 2e-4 of each gradient's norm. Some gradients are zero in exact arithmetic,
such as q_proj in a layer whose window is one token (each token reads only itself, so queries and keys change
nothing). There each kernel leaves only rounding noise, and a relative gap between two noises means nothing, so
every gap may also take 1e-6 of the whole model's gradient norm.

Under bf16 autocast the two kernels round differently, and their gap says little about which one is right. So each
is measured against the same model in fp32 through SDPA. FlexAttention may stray at most twice as far as SDPA does,
plus 1e-3 of the gradient's norm (the floor keeps a lucky near-exact SDPA gradient from failing flex)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_train.model import Transformer


def loss_and_grads(model: Transformer, tokens: torch.Tensor, bf16: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward of model.loss on tokens: the cross-entropy and every parameter's gradient (fp32)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
    (ce + aux).backward()
    return float(ce), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@dataclass(frozen=True)
class GradientGap:
    name: str
    reference_norm: float  # the fp32 SDPA gradient's norm
    sdpa_gap: float  # |SDPA - reference|: 0 in fp32, where SDPA is the reference
    flex_gap: float  # |flex - reference|
    allowed: float

    @property
    def ok(self) -> bool:
        return self.flex_gap <= self.allowed


@dataclass(frozen=True)
class KernelComparison:
    losses: dict[str, float]  # "sdpa", "flex" at the tested precision, "reference" (fp32 SDPA)
    gaps: list[GradientGap]
    total_norm: float  # the whole model's reference gradient norm
    reference_grads: dict[str, torch.Tensor]
    flex_grads: dict[str, torch.Tensor]

    def failures(self) -> list[GradientGap]:
        return [gap for gap in self.gaps if not gap.ok]


def compare_kernels(model: Transformer, tokens: torch.Tensor, bf16: bool, eos_id: int | None) -> KernelComparison:
    """Loss and gradients of model on tokens through SDPA and through FlexAttention (document masking with eos_id,
    or none, plus the model's own windows), each gradient's gap to the reference and what it is allowed."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    results = {}
    for kernel in ("sdpa", "flex"):
        model.set_document_masking(eos_id, kernel)
        assert model.document_masking_path(tokens.device, dtype) == kernel
        results[kernel] = loss_and_grads(model, tokens, bf16)
    if bf16:
        model.set_document_masking(eos_id, "sdpa")
        results["reference"] = loss_and_grads(model, tokens, bf16=False)
    else:
        results["reference"] = results["sdpa"]
    reference = results["reference"][1]
    total = float(torch.stack([g.norm() for g in reference.values()]).norm())
    gaps = []
    for name, want in reference.items():
        ref_norm = float(want.norm())
        sdpa_gap = float((results["sdpa"][1][name] - want).norm())
        flex_gap = float((results["flex"][1][name] - want).norm())
        if bf16:
            allowed = 2 * sdpa_gap + 1e-3 * ref_norm + 1e-6 * total
        else:
            allowed = 2e-4 * ref_norm + 1e-6 * total
        gaps.append(GradientGap(name, ref_norm, sdpa_gap, flex_gap, allowed))
    return KernelComparison({k: v[0] for k, v in results.items()}, gaps, total, reference, results["flex"][1])
