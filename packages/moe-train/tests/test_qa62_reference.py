"""QA 62: the model against an independent float64 reference written from the README and config.py.

The reference below reads the model's parameters by name and nothing else of moe_train: it is the
transformer as the README describes it, token by token and head by head, in float64 (RMSNorm as
x / sqrt(mean(x^2) + eps) * w; RoPE as a complex rotation of (x_i, x_{i + rd/2}) pairs over the leading
rd = rotary_fraction * head_dim dims; causal softmax attention with kv head h // (H / KV); SwiGLU;
the router's softmax/sigmoid, top-k on probabilities + expert bias, renormalisation, routed scaling;
E * sum f P and mean logsumexp^2; shared expert behind sigmoid(x . w); final norm; tied or untied head;
mean cross-entropy). Logits, losses and every parameter gradient must agree to float64 round-off.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer


# --------------------------------------------------------------------------------------- the reference

def ref_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def ref_rope(x: torch.Tensor, rd: int, theta: float) -> torch.Tensor:
    """x: [S, hd] of one head; the pair (x[i], x[i + rd/2]) at position p turns by p * theta^(-2i/rd)."""
    s, hd = x.shape
    half = rd // 2
    rows = []
    for p in range(s):
        row = list(x[p].unbind())
        for i in range(half):
            angle = p * theta ** (-2.0 * i / rd)
            z = torch.complex(x[p, i], x[p, i + half]) * complex(math.cos(angle), math.sin(angle))
            row[i], row[i + half] = z.real, z.imag
        rows.append(torch.stack(row))
    return torch.stack(rows)


def ref_attention(cfg: ModelConfig, P: dict, pre: str, x: torch.Tensor) -> torch.Tensor:
    """x: [S, d] of one sequence -> [S, d]."""
    H, KV = cfg.num_heads, cfg.num_kv_heads
    hd = cfg.head_dim or cfg.d_model // H
    rd = round(cfg.rotary_fraction * hd)

    def proj(name: str) -> torch.Tensor:
        y = x @ P[f"{pre}.{name}.weight"].T
        return y + P[f"{pre}.{name}.bias"] if cfg.attention_bias else y

    q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
    heads = []
    for h in range(H):
        g = h // (H // KV)
        qh, kh, vh = q[:, h * hd:(h + 1) * hd], k[:, g * hd:(g + 1) * hd], v[:, g * hd:(g + 1) * hd]
        if cfg.qk_norm:
            qh = ref_rmsnorm(qh, P[f"{pre}.q_norm.weight"], cfg.norm_eps)
            kh = ref_rmsnorm(kh, P[f"{pre}.k_norm.weight"], cfg.norm_eps)
        qh, kh = ref_rope(qh, rd, cfg.rope_theta), ref_rope(kh, rd, cfg.rope_theta)
        out = []
        for i in range(x.shape[0]):
            scores = torch.stack([qh[i] @ kh[j] / math.sqrt(hd) for j in range(i + 1)])
            a = torch.exp(scores - scores.max())
            a = a / a.sum()
            out.append((a[:, None] * vh[: i + 1]).sum(0))
        heads.append(torch.stack(out))
    return torch.cat(heads, -1) @ P[f"{pre}.o_proj.weight"].T


def ref_swiglu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """x: [d]; wg, wu: [d, h]; wd: [h, d]."""
    return (ref_silu(x @ wg) * (x @ wu)) @ wd


def ref_moe(cfg: ModelConfig, P: dict, B: dict, pre: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, d] (all tokens of the micro-batch) -> ([T, d], lb_w * lb + z_w * z)."""
    r, E = cfg.router, cfg.num_experts
    k, h = r.top_k, cfg.expert_hidden
    wr = P[f"{pre}.router.weight"]
    w1, w2 = P[f"{pre}.experts.w_gate_up"], P[f"{pre}.experts.w_down"]
    bias = B.get(f"{pre}.router.expert_bias")
    outs, counts, p_rows, z_terms = [], [0] * E, [], []
    for t in range(x.shape[0]):
        logits = torch.stack([x[t] @ wr[e] for e in range(E)])
        if r.gating == "softmax":
            ex = torch.exp(logits - logits.max())
            probs = ex / ex.sum()
        else:
            probs = 1 / (1 + torch.exp(-logits))
        score = [float(probs[e]) + (float(bias[e]) if r.expert_bias else 0.0) for e in range(E)]
        chosen = sorted(range(E), key=lambda e: -score[e])[:k]
        w = torch.stack([probs[e] for e in chosen])
        if r.normalize_top_k:
            w = w / w.sum()
        w = w * r.routed_scaling_factor
        y = sum(w[s] * ref_swiglu(x[t], w1[e, :, :h], w1[e, :, h:], w2[e]) for s, e in enumerate(chosen))
        if cfg.shared_expert_hidden:
            sh = ref_swiglu(x[t], P[f"{pre}.shared_expert.gate.weight"].T, P[f"{pre}.shared_expert.up.weight"].T,
                            P[f"{pre}.shared_expert.down.weight"].T)
            if cfg.shared_expert_gate:
                sh = sh / (1 + torch.exp(-(x[t] @ P[f"{pre}.shared_expert_gate.weight"][0])))
            y = y + sh
        outs.append(y)
        for e in chosen:
            counts[e] += 1
        p_rows.append(probs if r.gating == "softmax" else probs / probs.sum())
        m = logits.max()
        z_terms.append((m + torch.log(torch.exp(logits - m).sum())) ** 2)
    T = x.shape[0]
    P_mean = torch.stack(p_rows).sum(0) / T
    lb = E * sum(counts[e] / (T * k) * P_mean[e] for e in range(E))
    z = torch.stack(z_terms).sum() / T
    return torch.stack(outs), r.lb_loss_weight * lb + r.z_loss_weight * z


def ref_forward(cfg: ModelConfig, P: dict, B: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens: [Bt, S] -> (logits [Bt, S, V], aux summed over MoE layers)."""
    bt, s = tokens.shape
    x = P["embed.weight"][tokens.reshape(-1)].reshape(bt, s, -1)
    aux = torch.zeros((), dtype=torch.float64)
    for i in range(cfg.num_layers):
        pre = f"blocks.{i}"
        a_in = ref_rmsnorm(x, P[f"{pre}.attn_norm.weight"], cfg.norm_eps)
        x = x + torch.stack([ref_attention(cfg, P, f"{pre}.attn", a_in[b]) for b in range(bt)])
        m_in = ref_rmsnorm(x, P[f"{pre}.mlp_norm.weight"], cfg.norm_eps)
        if cfg.num_experts > 0 and i not in cfg.dense_layers:
            y, a = ref_moe(cfg, P, B, f"{pre}.mlp", m_in.reshape(bt * s, -1))
            x = x + y.reshape(bt, s, -1)
            aux = aux + a
        else:
            wg, wu, wd = (P[f"{pre}.mlp.{n}.weight"].T for n in ("gate", "up", "down"))
            x = x + torch.stack([torch.stack([ref_swiglu(x_t, wg, wu, wd) for x_t in row]) for row in m_in])
    head = P["embed.weight"] if cfg.tie_embeddings else P["lm_head.weight"]
    return ref_rmsnorm(x, P["norm.weight"], cfg.norm_eps) @ head.T, aux


def ref_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    flat, tg = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    terms = []
    for row, t in zip(flat, tg):
        m = row.max()
        terms.append(m + torch.log(torch.exp(row - m).sum()) - row[t])
    return torch.stack(terms).mean()


# --------------------------------------------------------------------------------------- the cases

def _cfg(**kw) -> ModelConfig:
    router = kw.pop("router", {})
    base = dict(vocab_size=13, d_model=12, num_layers=2, num_heads=2, num_kv_heads=1, dense_hidden=10,
                num_experts=0, expert_hidden=6, norm_eps=1e-5, rope_theta=37.0, gemm_backend="reference")
    return ModelConfig(**{**base, **kw}, router=RouterConfig(**{"lb_loss_weight": 0.3, "z_loss_weight": 0.05,
                                                                **router}))


CASES = {
    # dense, odd sizes, 2 q heads on 1 kv head, QK-norm, biases, tied head
    "dense_mha_tied": (_cfg(d_model=18, num_heads=3, num_kv_heads=3, qk_norm=True, attention_bias=True,
                             tie_embeddings=True, dense_hidden=7), 2, 5),
    "dense_gqa3_seq1": (_cfg(d_model=18, num_heads=3, num_kv_heads=1, dense_hidden=7), 3, 1),
    # a single expert, top-1 weighted by its probability
    "moe_e1_top1": (_cfg(num_experts=1, router={"top_k": 1, "normalize_top_k": False}, num_layers=1), 2, 3),
    # top_k = E, sigmoid gating, expert bias (selection only), scaled, gated shared expert, a dense layer,
    # half rotary, 2 q heads per kv head
    "moe_topk_eq_e_sigmoid_bias": (_cfg(d_model=16, num_heads=4, num_kv_heads=2, rotary_fraction=0.5,
                                        num_experts=5, num_layers=3, dense_layers=[1], shared_expert_hidden=5,
                                        shared_expert_gate=True,
                                        router={"top_k": 5, "gating": "sigmoid", "expert_bias": True,
                                                "routed_scaling_factor": 2.5}), 1, 4),
    # many experts, explicit head_dim (q width != d_model), QK-norm, 4 q heads per kv head, quarter rotary,
    # odd sequence, shared expert without gate, expert bias with softmax
    "moe_e7_top3_headdim": (_cfg(d_model=10, num_heads=8, num_kv_heads=2, head_dim=8, rotary_fraction=0.25,
                                 qk_norm=True, attention_bias=True, num_experts=7, shared_expert_hidden=3,
                                 router={"top_k": 3, "expert_bias": True, "routed_scaling_factor": 0.7}), 2, 7),
    "moe_sigmoid_unnormalised_untied_first_dense": (
        _cfg(d_model=15, num_heads=2, num_kv_heads=2, head_dim=6, num_experts=4, dense_layers=[0], num_layers=2,
             router={"top_k": 2, "gating": "sigmoid", "normalize_top_k": False}), 2, 3),
}


def _randomise(model: Transformer, seed: int) -> None:
    """Every parameter and the expert bias away from its init (norm weights around 1, biases nonzero), so a
    term the model dropped or misplaced would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=b.dtype))


@pytest.mark.parametrize("case", [*CASES, "moe_e7_top3_headdim@auto", "moe_topk_eq_e_sigmoid_bias@auto"])
def test_float64_logits_losses_and_every_gradient_match_the_reference(case):
    """Every case on the reference expert GEMMs; two again on the backend a run picks by default (auto)."""
    name, _, backend = case.partition("@")
    cfg, bt, s = CASES[name]
    if backend:
        cfg = dataclasses.replace(cfg, gemm_backend=backend)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    _randomise(model, 62)
    model.train()
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (bt, s), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (bt, s), generator=g)
    cot = torch.randn(bt, s, cfg.vocab_size, generator=g, dtype=torch.float64)

    logits, aux = model(tokens)
    ce, aux2 = model.loss(tokens, targets)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(ce + aux2 + (logits * cot).sum(), params)

    P = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    if cfg.tie_embeddings:
        assert "lm_head.weight" not in P  # tied: one parameter, reached by the embedding and the head
    B = {n: b.detach().clone() for n, b in model.named_buffers()}
    ref_logits, ref_aux = ref_forward(cfg, P, B, tokens)
    ref_ce = ref_cross_entropy(ref_logits, targets)
    ref_grads = torch.autograd.grad(ref_ce + ref_aux + (ref_logits * cot).sum(), [P[n] for n in names],
                                    allow_unused=True)

    tol = dict(rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(logits, ref_logits, **tol)
    assert logits.dtype == torch.float64 and ce.dtype == torch.float64
    # a dense model's aux is a float32 zero (no router); an MoE model's is float64
    torch.testing.assert_close(aux, ref_aux, **tol, check_dtype=cfg.num_experts > 0)
    torch.testing.assert_close(aux2, ref_aux, **tol, check_dtype=cfg.num_experts > 0)
    torch.testing.assert_close(ce, ref_ce, **tol)
    for n, a, b in zip(names, grads, ref_grads):
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=n: f"{case}: gradient of {n}: {m}")
