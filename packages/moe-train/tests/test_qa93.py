"""QA 93: are the numbers moe-train reports true (parameter counts, FLOPs per token, MFU, `info`)?

Checked against the real model, not a second copy of the formula: count_params' total is the built Transformer's
parameters (a tied matrix once) and its active is that total less the routed experts a token does not select;
flops_per_token's matmul part is exactly what torch's FlopCounterMode counts for the model's forward (x3 for
forward + backward, also exact) with the per-expert reference GEMMs (FlopCounterMode does not count
`_grouped_mm`, the CPU "torch" backend); its attention term is half the S x S that FlopCounterMode counts for
SDPA (causal, as documented). `moe-train info` prints count_params / flops_per_token of every preset, and the
README's figures (46.86B / 3.17B for olmo3-bench-e128, 0.71 / 1.92 / 6.75B and 276 / 235 / 149 TFLOP/s at
68.3K / 58.1K / 36.6K tokens/s for fine-grained-e8/32/128) follow from them. All of that held.

Found: (1) MFU was against the bf16 peak also for a GPU run whose GEMMs run in fp32 (train.autocast_bf16=false
with fp32 weights: about 15x too low on an H100, 989 vs 67 TFLOP/s); mfu.run_peak_tflops gives such a run no
peak and `bench` reports no MFU for it (the Trainer, trainer/loop.py, still calls peak_tflops(device): left to its
owner). (2) count_params / flops_per_token accepted configs the model refuses and returned impossible numbers
(top_k=8 of 4 experts: 2.82M active of 2.03M total; seq_len=0 or negative); they now raise ConfigError as
Transformer does.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moe_train.config import Config, ConfigError, ModelConfig, ParallelConfig, RouterConfig, TrainConfig
from moe_train.model import Transformer, count_params, flops_per_token
from moe_train.model.moe import RoutedExperts

BASE = dict(vocab_size=96, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden=48, num_experts=4,
            expert_hidden=16, gemm_backend="reference")  # reference: per-expert mm, which FlopCounterMode counts
MODELS = {
    "dense-tied": dict(num_experts=0, tie_embeddings=True),
    "top1-mqa-qknorm": dict(num_kv_heads=1, qk_norm=True, router=RouterConfig(top_k=1, normalize_top_k=False)),
    "top4-of-4-mha-head-dim": dict(num_kv_heads=4, head_dim=12, router=RouterConfig(top_k=4)),
    "everything": dict(head_dim=12, qk_norm=True, attention_bias=True, tie_embeddings=True, shared_expert_hidden=8,
                       shared_expert_gate=True, dense_layers=[1], rotary_fraction=0.5,
                       router=RouterConfig(top_k=3, expert_bias=True, gating="sigmoid")),
}


def model_of(name: str) -> ModelConfig:
    return ModelConfig(**{**BASE, **MODELS[name]})


def matmul_and_attention_flops(model: Transformer, tokens: torch.Tensor, backward: bool) -> tuple[int, int]:
    counter = FlopCounterMode(display=False)
    with counter:
        logits, aux = model(tokens)
        if backward:
            (logits.square().mean() + aux).backward()
    flops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = sum(n for op, n in flops.items() if "scaled_dot_product" in op)
    return flops.get("aten.mm", 0) + flops.get("aten.addmm", 0), attention


@pytest.mark.parametrize("name", MODELS)
def test_counts_and_flops_per_token_are_what_the_built_model_holds_and_computes(name):
    """total = the built model's parameters; active = total less the unselected experts' weights (whole embedding
    and lm head counted); 6 x matmul weights = FlopCounterMode's mm FLOPs of a forward + backward, exactly; the
    causal attention term = half FlopCounterMode's full S x S SDPA forward, x3."""
    cfg, seq, batch = model_of(name), 12, 2
    torch.manual_seed(0)
    model = Transformer(cfg)
    counts = count_params(cfg)
    total = sum(p.numel() for p in model.parameters())  # a tied matrix is yielded once
    unselected = sum((m.w_gate_up[0].numel() + m.w_down[0].numel()) * (cfg.num_experts - cfg.router.top_k)
                     for m in model.modules() if isinstance(m, RoutedExperts))
    assert (counts.total, counts.active) == (total, total - unselected)
    assert counts.embedding == model.embed.weight.numel() * (1 if cfg.tie_embeddings else 2)

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    fwd_mm, fwd_attention = matmul_and_attention_flops(model, tokens, backward=False)
    both_mm, _ = matmul_and_attention_flops(model, tokens, backward=True)
    attention_term = 6 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq
    matmul_term = flops_per_token(cfg, seq) - attention_term
    assert 3 * fwd_mm == both_mm == matmul_term * batch * seq
    assert fwd_attention == 2 * (attention_term // 3) * batch * seq  # full S x S counted; the formula halves it


@pytest.mark.parametrize("fields,seq_len", [
    (dict(router=RouterConfig(top_k=8)), 16),  # 8 of 4 experts: active was above total
    (dict(dense_layers=[5]), 16),  # no layer 5: counted as if the model had no dense layer
    ({}, 0),
    ({}, -100),
])
def test_accounting_refuses_what_the_model_refuses(fields, seq_len):
    cfg = ModelConfig(**{**BASE, **fields})
    with pytest.raises(ConfigError):
        flops_per_token(cfg, seq_len)
    if fields:
        with pytest.raises(ConfigError):
            count_params(cfg)


@pytest.mark.parametrize("autocast,param_dtype,peak", [(True, "fp32", 989.0), (False, "bf16", 989.0),
                                                        (False, "fp32", None)])
def test_mfu_is_against_the_bf16_peak_only_when_the_gemms_run_in_bf16(monkeypatch, autocast, param_dtype, peak):
    """fp32 GEMMs (no autocast, fp32 weights) cannot reach the bf16 tensor-core peak: no MFU rather than one ~15x
    low. On the CPU there is none either way."""
    from moe_train.trainer.mfu import run_peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cfg = Config(train=TrainConfig(autocast_bf16=autocast), parallel=ParallelConfig(param_dtype=param_dtype))
    assert run_peak_tflops(cfg, torch.device("cuda")) == peak
    assert run_peak_tflops(cfg, torch.device("cpu")) is None


def test_info_prints_the_accounting_of_every_preset(capsys):
    from moe_train.cli import main
    from moe_train.config_io import build_config
    from moe_train.presets import PRESETS

    for preset in PRESETS:
        assert main(["info", "--preset", preset]) in (0, None)
        out = json.loads(capsys.readouterr().out)
        cfg = build_config(preset)
        c = count_params(cfg.model)
        assert (out["params_total"], out["params_active"], out["params_embedding"], out["flops_per_token"]) == \
            (c.total, c.active, c.embedding, flops_per_token(cfg.model, cfg.data.seq_len)), preset
    # README's "Earlier numbers": fine-grained-e8 / e32 / e128 of 0.71B / 1.92B / 6.75B, and their model TFLOP/s at
    # the table's tokens/s (rounded to 3 figures: within 0.5%; bench/results' unrounded 36,644 gives 148.5 -> 149)
    for experts, params_b, tokens_per_s, tflops in ((8, 0.71, 68.3e3, 276), (32, 1.92, 58.1e3, 235),
                                                    (128, 6.75, 36.6e3, 149)):
        cfg = build_config(f"fine-grained-e{experts}")
        assert round(count_params(cfg.model).total / 1e9, 2) == params_b
        assert abs(flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_s / 1e12 / tflops - 1) < 0.005
