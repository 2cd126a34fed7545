"""Parameter counts and model FLOPs per token, computed from the config (no model needed)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # parameters touched by one token (top-k routed experts + shared + dense parts)
    embedding: int


def count_params(cfg: ModelConfig) -> ParamCounts:
    d, hd = cfg.d_model, cfg.resolved_head_dim
    attn = d * cfg.num_heads * hd * 2 + d * cfg.num_kv_heads * hd * 2
    attn += 2 * hd if cfg.qk_norm else 0
    norms = 2 * d
    total = active = 0
    for i in range(cfg.num_layers):
        total += attn + norms
        active += attn + norms
        if cfg.is_moe_layer(i):
            expert = 3 * d * cfg.expert_hidden
            shared = 3 * d * cfg.shared_expert_hidden
            router = cfg.num_experts * d
            total += cfg.num_experts * expert + shared + router
            active += cfg.router.top_k * expert + shared + router
        else:
            total += 3 * d * cfg.dense_hidden
            active += 3 * d * cfg.dense_hidden
    embedding = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    total += embedding + d
    active += embedding + d
    return ParamCounts(total=total, active=active, embedding=embedding)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 x active matmul parameters (input embedding excluded) + causal attention."""
    counts = count_params(cfg)
    matmul_params = counts.active - cfg.vocab_size * cfg.d_model  # the input embedding is a lookup
    if cfg.tie_embeddings:
        matmul_params += cfg.vocab_size * cfg.d_model
    # QK^T and AV: 2 matmuls x 2 flops x seq x heads*hd, halved by causality, x3 for fwd+bwd.
    attention = 6 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq_len
    return 6 * matmul_params + attention
