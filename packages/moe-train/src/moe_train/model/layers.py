"""Small building blocks: RMSNorm, the dense SwiGLU MLP (rotary embeddings: rope.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_precision import PrecisionRecipe


def fp32_or_wider(dtype: torch.dtype) -> torch.dtype:
    """The dtype the precision-sensitive pieces (norms, router logits, rotary, losses) compute in: fp32 for
    bf16/fp16/fp32 data, float64 for float64 data (an fp64 model stays fp64 end to end, as autocast keeps it)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim]; normalises in fp32 (float64 for float64 x), returns x's dtype. torch's fused rms_norm:
        on an H200 one [8192, 2048] fp32 norm's forward+backward takes 0.20 ms, the five-op formula 0.70 ms."""
        wide = fp32_or_wider(x.dtype)
        return F.rms_norm(x.to(wide), (x.shape[-1],), self.weight.to(wide), self.eps).to(x.dtype)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int, recipe: PrecisionRecipe):
        super().__init__()
        self.gate = recipe.linear(d_model, hidden)
        self.up = recipe.linear(d_model, hidden)
        self.down = recipe.linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
