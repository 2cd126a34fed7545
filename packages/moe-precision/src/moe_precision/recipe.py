"""Precision recipes: the one place the linear and expert modules ask which number format to use.

Only "bf16" (autocast / native-dtype GEMMs with fp32 master weights upstream) exists today.
"mxfp8" is reserved: it names the seam MXFP8 GEMMs will plug into, and is refused until built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

KNOWN_RECIPES = ("bf16",)
PLANNED_RECIPES = ("mxfp8",)


@dataclass(frozen=True)
class PrecisionRecipe:
    name: str = "bf16"

    def __post_init__(self) -> None:
        if self.name in PLANNED_RECIPES:
            raise NotImplementedError(
                f"precision recipe {self.name!r} is planned but not built yet; use one of {KNOWN_RECIPES}"
            )
        if self.name not in KNOWN_RECIPES:
            raise ValueError(f"precision recipe {self.name!r} is unknown; expected one of {KNOWN_RECIPES}")

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        """The dense linear layer for this recipe: x: [..., in] -> [..., out]."""
        return nn.Linear(in_features, out_features, bias=bias)

    def expert_gemm_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype grouped expert GEMMs run in for input x (the autocast dtype when enabled)."""
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype
