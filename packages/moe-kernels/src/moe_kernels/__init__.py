"""moe-kernels: MoE routing, permute/combine, grouped GEMM and token dispatch on plain tensors."""

from moe_kernels.all_to_all import AllToAllDispatcher
from moe_kernels.dispatch import DispatchResult, IdentityCodec, LocalDispatcher, PayloadCodec, TokenDispatcher
from moe_kernels.expert_ffn import moe_ffn, swiglu_experts
from moe_kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from moe_kernels.permute import combine, permute
from moe_kernels.route_map import RouteMap, build_route_map

__version__ = "0.10.0"

__all__ = [
    "RouteMap",
    "build_route_map",
    "permute",
    "combine",
    "grouped_gemm",
    "grouped_gemm_reference",
    "swiglu_experts",
    "moe_ffn",
    "TokenDispatcher",
    "LocalDispatcher",
    "AllToAllDispatcher",
    "DispatchResult",
    "PayloadCodec",
    "IdentityCodec",
]
