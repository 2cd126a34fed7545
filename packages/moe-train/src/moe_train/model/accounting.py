"""Parameter counts and model FLOPs per token, computed from the config (no model needed)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config import ConfigError, ModelConfig, validate_model


@dataclass(frozen=True)
class ParamCounts:
    """total: every parameter of the built model, a tied embedding / lm head matrix once. active: total less the
    routed experts a token does not select ((num_experts - top_k) x 3 x d x expert_hidden per MoE layer), so the
    whole embedding and lm head matrices count, as is usual. embedding: those matrices (one when tied)."""

    total: int
    active: int
    embedding: int


def count_params(cfg: ModelConfig) -> ParamCounts:
    """The parameter counts of Transformer(cfg); cfg is checked as Transformer checks it (a top_k above
    num_experts counted more active parameters than the model has)."""
    validate_model(cfg)
    d, hd = cfg.d_model, cfg.resolved_head_dim
    attn = d * cfg.num_heads * hd * 2 + d * cfg.num_kv_heads * hd * 2
    total = active = norm_params(cfg) + attention_bias_params(cfg)
    for i in range(cfg.num_layers):
        total += attn
        active += attn
        if cfg.is_moe_layer(i):
            expert = 3 * d * cfg.expert_hidden
            shared = 3 * d * cfg.shared_expert_hidden
            if cfg.shared_expert_gate and cfg.shared_expert_hidden > 0:  # Linear(d, 1), a matmul like the router
                shared += d
            router = cfg.num_experts * d
            total += cfg.num_experts * expert + shared + router
            active += cfg.router.top_k * expert + shared + router
        else:
            total += 3 * d * cfg.dense_hidden
            active += 3 * d * cfg.dense_hidden
    embedding = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    total += embedding
    active += embedding
    return ParamCounts(total=total, active=active, embedding=embedding)


def norm_params(cfg: ModelConfig) -> int:
    """RMSNorm weights: two per layer (+ per-head q/k norms), the final one. Elementwise, not matmul, weights."""
    per_layer = 2 * cfg.d_model + (2 * cfg.resolved_head_dim if cfg.qk_norm else 0)
    return cfg.num_layers * per_layer + cfg.d_model


def attention_bias_params(cfg: ModelConfig) -> int:
    """The q/k/v projection biases of every layer (model.attention_bias). Added, not matmul, weights."""
    return cfg.num_layers * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.resolved_head_dim if cfg.attention_bias else 0


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 x active matmul parameters (the weights of attention, dense and expert
    MLPs at top-k, shared experts and their gates, routers and the lm head; not the input embedding, a lookup,
    nor the norm weights and attention biases) + causal attention (model.sliding_window_pattern's windows read
    fewer keys)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"flops_per_token: seq_len={seq_len!r}: expected a positive integer")
    counts = count_params(cfg)
    # the embedding lookup, norms and biases
    matmul_params = counts.active - cfg.vocab_size * cfg.d_model - norm_params(cfg) - attention_bias_params(cfg)
    if cfg.tie_embeddings:
        matmul_params += cfg.vocab_size * cfg.d_model
    # QK^T and AV: 2 matmuls x 2 flops x heads*hd x the keys a token reads, x3 for fwd+bwd. Causal: seq / 2 keys
    # on average; a sliding window w < seq: w - w^2 / (2 seq) (min(position, w), averaged over the positions).
    keys = sum(w - w * w / (2 * seq_len) if 0 < w < seq_len else seq_len / 2
               for w in map(cfg.attention_window, range(cfg.num_layers)))
    return 6 * matmul_params + round(12 * cfg.num_heads * cfg.resolved_head_dim * keys)
