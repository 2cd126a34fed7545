"""moe-kernels: MoE routing, permute/combine, grouped GEMM and token dispatch on plain tensors."""

from moe_kernels.dispatch import DispatchResult, IdentityCodec, LocalDispatcher, PayloadCodec, TokenDispatcher
from moe_kernels.expert_ffn import swiglu_experts
from moe_kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from moe_kernels.permute import combine, permute
from moe_kernels.route_map import RouteMap, build_route_map

__version__ = "0.1.0"

__all__ = [
    "RouteMap",
    "build_route_map",
    "permute",
    "combine",
    "grouped_gemm",
    "grouped_gemm_reference",
    "swiglu_experts",
    "TokenDispatcher",
    "LocalDispatcher",
    "DispatchResult",
    "PayloadCodec",
    "IdentityCodec",
]
