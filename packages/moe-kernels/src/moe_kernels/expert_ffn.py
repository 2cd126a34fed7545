"""The routed-expert SwiGLU FFN as one functional op: permute, two grouped GEMMs, combine.

Fast backends replace this whole op (fusing the gather, SwiGLU and routing weight into the
GEMMs) behind the same signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_kernels.grouped_gemm import GemmBackend, grouped_gemm


def swiglu_experts(
    x_sorted: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor,
    backend: GemmBackend = "auto",
) -> torch.Tensor:
    """Expert SwiGLU on rows already in expert order.

    x_sorted: [N, d]; w_gate_up: [E, d, 2h] (gate then up); w_down: [E, h, d]; offsets: [E] int32 -> [N, d].
    """
    h = grouped_gemm(x_sorted, w_gate_up, offsets, backend)
    gate, up = h.chunk(2, dim=-1)
    return grouped_gemm(F.silu(gate) * up, w_down, offsets, backend)
