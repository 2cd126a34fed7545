"""Precision recipes: the one place the linear and expert modules ask which number format to use.

Only "bf16" (autocast / native-dtype GEMMs with fp32 master weights upstream) exists today.
"mxfp8" is reserved: it names the seam MXFP8 GEMMs will plug into, and is refused until built. A recipe owns
the dense layers (`linear`) and the expert FFN's GEMMs (`expert_ffn`, `fused_moe_ffn`): an MXFP8 recipe
replaces those to quantise rows and weights and run its own grouped GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_kernels import RouteMap, moe_ffn, swiglu_experts
from moe_precision.cast import cast_weight

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
        """The dense linear layer for this recipe: x: [..., in] -> [..., out]. An nn.Linear (same
        parameters and state_dict) whose weight reaches the GEMM through `gemm_weight`."""
        return Bf16Linear(in_features, out_features, bias=bias)

    def expert_gemm_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype grouped expert GEMMs run in for input x (the autocast dtype when enabled)."""
        return gemm_dtype(x, x.dtype)

    def gemm_weight(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Weight w as the GEMM with input x consumes it (expert_gemm_dtype), differentiable, its
        gradient cast back to w's dtype by a fast kernel (cast.cast_weight)."""
        return cast_weight(w, self.expert_gemm_dtype(x))

    def gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x as the expert GEMMs consume them: cast to expert_gemm_dtype (autocast casts no grouped GEMM's
        input, so fp32 rows under bf16 autocast, e.g. a codec's decode, would meet bf16 weights), differentiable."""
        dtype = self.expert_gemm_dtype(x)
        return x if x.dtype == dtype else x.to(dtype)

    def expert_ffn(self, rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, offsets: torch.Tensor,
                   backend: str = "auto") -> torch.Tensor:
        """The SwiGLU expert FFN over dispatched rows [N, d] in expert order (offsets: each expert's end row)
        -> [N, d]: moe_kernels.swiglu_experts, with the rows and both weights as this recipe's GEMMs consume them."""
        _require_tensors(rows=(rows, "[N, d]"), w_gate_up=(w_gate_up, "[E, d, 2h]"), w_down=(w_down, "[E, h, d]"))
        rows = self.gemm_input(rows)
        return swiglu_experts(rows, self.gemm_weight(w_gate_up, rows), self.gemm_weight(w_down, rows), offsets,
                              backend)

    def fused_moe_ffn(self, x: torch.Tensor, route_map: RouteMap, router_weights: torch.Tensor,
                      w_gate_up: torch.Tensor, w_down: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """The whole expert block of tokens x [T, d] whose experts are all local: gather by route_map, the SwiGLU
        expert FFN, combine with router_weights [T, k] -> [T, d] (moe_kernels.moe_ffn, the gather and the
        combine fused into the GEMMs), with both weights as this recipe's GEMMs consume them."""
        _require_tensors(x=(x, "[T, d]"), w_gate_up=(w_gate_up, "[E, d, 2h]"), w_down=(w_down, "[E, h, d]"))
        x = self.gemm_input(x)
        return moe_ffn(x, route_map, router_weights, self.gemm_weight(w_gate_up, x), self.gemm_weight(w_down, x),
                       backend)


class Bf16Linear(nn.Linear):
    """nn.Linear whose weight is cast for the GEMM by `cast_weight` (autocast would cast it too, with
    torch's slower gradient cast back to fp32); autocast still casts the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gemm_weight(x), self.bias)

    def gemm_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The weight [out, in] as this layer's GEMM consumes it for input x (the autocast dtype when enabled),
        differentiable: a caller that runs the GEMM itself (a chunked LM head and loss) casts the weight once."""
        return cast_weight(self.weight, gemm_dtype(x, self.weight.dtype))


def _require_tensors(**named: tuple[object, str]) -> None:
    """The weights are cast (reading the rows' dtype) before moe_kernels checks its arguments: a None or a numpy
    array failed on a missing `.dtype`, naming no argument. Same words as moe_kernels' own checks."""
    for name, (value, shape) in named.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(value).__name__}")


def autocast_casts(dtype: torch.dtype) -> bool:
    """Whether autocast casts a tensor of `dtype` to its lower precision: floating point other than float64
    (autocast leaves fp64 tensors, and every non-float one, in their own dtype: fp64 GEMMs stay fp64)."""
    return dtype.is_floating_point and dtype != torch.float64


def gemm_dtype(x: torch.Tensor, otherwise: torch.dtype) -> torch.dtype:
    """The autocast dtype of x's device when autocast is on there, else `otherwise` (and on devices without
    autocast, such as meta: shape-only forwards). `otherwise` is the dtype of the tensor being cast: one that
    autocast would not cast (float64) keeps it, as nn.Linear's weight does under autocast."""
    device = x.device.type
    if not autocast_casts(otherwise):
        return otherwise
    # under torch.compile the device has autocast (cpu or cuda), and dynamo (torch 2.11) cannot trace the query
    available = torch.compiler.is_compiling() or torch.amp.is_autocast_available(device)
    if available and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return otherwise
