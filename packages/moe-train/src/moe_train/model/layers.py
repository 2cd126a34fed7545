"""Small building blocks: RMSNorm, the dense SwiGLU MLP (rotary embeddings: rope.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_precision import PrecisionRecipe


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim]; normalises in fp32, returns x's dtype. torch's fused rms_norm: on an H200 one
        [8192, 2048] fp32 norm's forward+backward takes 0.20 ms, the five-op formula 0.70 ms."""
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int, recipe: PrecisionRecipe):
        super().__init__()
        self.gate = recipe.linear(d_model, hidden)
        self.up = recipe.linear(d_model, hidden)
        self.down = recipe.linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
