"""Grouped-query causal self-attention through scaled_dot_product_attention, optional QK-norm, q/k/v biases,
partial rotary and a mask (train.document_masking's documents, model.sliding_window_pattern's windows: SDPA with an
additive mask or FlexAttention with a block mask, model/document_mask.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from moe_precision import PrecisionRecipe
from moe_train.config import ModelConfig, validate_model
from moe_train.model.document_mask import flex_document_attention
from moe_train.model.layers import RMSNorm
from moe_train.model.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe):
        super().__init__()
        validate_model(cfg)  # also when built alone, outside a Transformer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.resolved_head_dim
        # model.attention_bias: biases on q, k and v, none on o (GLM-4-MoE's attention_bias, Qwen2-MoE's qkv_bias)
        self.q_proj = recipe.linear(cfg.d_model, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = recipe.linear(cfg.d_model, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = recipe.linear(cfg.d_model, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = recipe.linear(self.num_heads * self.head_dim, cfg.d_model)
        # QK-norm per head, before RoPE (Qwen3 / GLM placement; OLMoE and OLMo-core norm the whole q / k projection).
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        """x: [B, S, d] -> [B, S, d]. mask: None (causal), a BlockMask (attention_block_mask: FlexAttention) or
        [B or 1, 1, S, S], causal already (attention_mask): bool, True where a query (row) may attend a key
        (column), or additive (0 or -inf; attention_bias), cast to the query's dtype when it is another."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(mask, BlockMask):
            out = flex_document_attention(q, k, v, mask)  # shares the kv heads itself
        else:
            if self.num_kv_heads != self.num_heads:
                rep = self.num_heads // self.num_kv_heads
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
                mask = mask.to(q.dtype)  # SDPA takes a float mask in the query's dtype only
            out = (F.scaled_dot_product_attention(q, k, v, is_causal=True) if mask is None
                   else F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))
