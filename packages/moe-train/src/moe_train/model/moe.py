"""The MoE block: router, routed experts behind a token dispatcher, optional shared expert (optionally gated)."""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import IdentityCodec, LocalDispatcher, TokenDispatcher, build_route_map
from moe_precision import PrecisionRecipe
from moe_train.config import ConfigError, ModelConfig, validate_model
from moe_train.model.layers import SwiGLU
from moe_train.model.router import Router


class RoutedExperts(nn.Module):
    """Weights of the experts held on this rank: w_gate_up [E_local, d, 2h] (gate | up), w_down [E_local, h, d]."""

    def __init__(self, num_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, d_model, 2 * hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, d_model))


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe):
        super().__init__()
        validate_model(cfg)  # also when built alone, outside a Transformer
        if cfg.num_experts < 1:
            raise ConfigError(f"MoELayer: model.num_experts={cfg.num_experts}: expected >= 1 (0 is a dense model, "
                              "whose layers are dense SwiGLUs)")
        self.num_experts = cfg.num_experts
        self.gemm_backend = cfg.gemm_backend
        self.recipe = recipe
        self.router = Router(cfg.d_model, cfg.num_experts, cfg.router)
        self.experts = RoutedExperts(cfg.num_experts, cfg.d_model, cfg.expert_hidden)
        self.shared_expert = (
            SwiGLU(cfg.d_model, cfg.shared_expert_hidden, recipe) if cfg.shared_expert_hidden > 0 else None
        )
        # model.shared_expert_gate: Qwen2-MoE's learned per-token gate, Linear(d, 1) without bias.
        self.shared_expert_gate = (
            recipe.linear(cfg.d_model, 1) if cfg.shared_expert_gate and self.shared_expert is not None else None
        )
        # The transport: local by default; expert parallelism swaps in an all-to-all dispatcher.
        self.dispatcher: TokenDispatcher = LocalDispatcher(cfg.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, S, d] -> ([B, S, d], aux loss)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routed = self.router(flat)
        route_map = build_route_map(routed.expert_ids, self.num_experts)
        rows = flat.to(self.recipe.expert_gemm_dtype(flat))
        w1, w2 = self.experts.w_gate_up, self.experts.w_down  # the recipe casts them as its GEMMs consume them
        d = self.dispatcher
        if type(d) is LocalDispatcher and type(d.codec) is IdentityCodec:
            # all experts here and nothing to encode: the fused block (gather, SwiGLU, combine in the GEMMs). The
            # exact types: a subclass may override dispatch, combine or the codec's calls, and must be run
            out = self.recipe.fused_moe_ffn(rows, route_map, routed.weights, w1, w2, self.gemm_backend)
        else:
            result = d.dispatch(rows, route_map)
            expert_out = self.recipe.expert_ffn(result.rows, w1, w2, result.offsets, self.gemm_backend)
            out = d.combine(expert_out, result, routed.weights)
            self.router.record_dropped(result.dropped)  # rows past a capacity: counted in the layer's health
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:  # [T, 1]: one scale per token
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.reshape(shape).to(x.dtype), routed.aux_loss
