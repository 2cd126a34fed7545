"""QA 61: every model option the Hugging Face export maps, exported as a user does it (`export_hf(model, ...)`),
loaded by stock transformers in fp32 (logits on the same tokens, greedy generation) and imported back
(`import_hf`, every tensor bit-exact).

Each case is a tiny model (d <= 40, 2-3 layers) whose norms, biases, gates and expert biases are all random,
so a mapping that drops or misplaces one of them shows in the logits.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_train.config import ModelConfig
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import one_thread, our_greedy, random_model  # noqa: E402,F401 - autouse: one thread

BASE = dict(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=40, num_experts=4,
            expert_hidden=16, init_std=0.1, rope_theta=1000.0, norm_eps=1e-5)
SIG = dict(gating="sigmoid", top_k=2)

# name -> (ModelConfig overrides, the class transformers must load it as)
CASES = {
    # dense models
    "llama": (dict(num_experts=0), "LlamaForCausalLM"),
    "llama_bias_tied_mha": (dict(num_experts=0, attention_bias=True, tie_embeddings=True, num_kv_heads=4),
                            "LlamaForCausalLM"),
    "llama_mqa": (dict(num_experts=0, num_kv_heads=1), "LlamaForCausalLM"),
    "qwen3": (dict(num_experts=0, qk_norm=True, attention_bias=True), "Qwen3ForCausalLM"),
    "llama_wide_heads": (dict(num_experts=0, head_dim=16), "LlamaForCausalLM"),
    "qwen3_head_dim_not_dividing": (dict(num_experts=0, qk_norm=True, d_model=30, num_heads=4, head_dim=8),
                                    "Qwen3ForCausalLM"),
    # softmax + qk_norm: Qwen3-MoE
    "qwen3_moe": (dict(qk_norm=True), "Qwen3MoeForCausalLM"),
    "qwen3_moe_dense_mixed_bias": (dict(qk_norm=True, num_layers=3, dense_layers=[1], attention_bias=True),
                                   "Qwen3MoeForCausalLM"),
    "qwen3_moe_one_expert": (dict(qk_norm=True, num_experts=1, router=dict(top_k=1, normalize_top_k=False)),
                             "Qwen3MoeForCausalLM"),
    "qwen3_moe_topk_all_no_renorm": (dict(qk_norm=True, router=dict(top_k=4, normalize_top_k=False)),
                                     "Qwen3MoeForCausalLM"),
    "qwen3_moe_topk_all_renorm": (dict(qk_norm=True, router=dict(top_k=4)), "Qwen3MoeForCausalLM"),
    "qwen3_moe_odd_sizes_tied": (dict(qk_norm=True, d_model=26, num_heads=3, num_kv_heads=1, head_dim=10,
                                      expert_hidden=13, dense_hidden=21, dense_layers=[0], tie_embeddings=True),
                                 "Qwen3MoeForCausalLM"),
    # softmax, no qk_norm: Qwen2-MoE
    "qwen2_moe_no_shared": (dict(), "Qwen2MoeForCausalLM"),
    "qwen2_moe_shared_ungated": (dict(shared_expert_hidden=24), "Qwen2MoeForCausalLM"),
    "qwen2_moe_shared_gated_bias_mixed": (dict(shared_expert_hidden=24, shared_expert_gate=True, attention_bias=True,
                                               num_layers=3, dense_layers=[0, 2]), "Qwen2MoeForCausalLM"),
    "qwen2_moe_one_expert_shared": (dict(num_experts=1, shared_expert_hidden=16,
                                         router=dict(top_k=1, normalize_top_k=False)), "Qwen2MoeForCausalLM"),
    "qwen2_moe_mqa_topk_all": (dict(num_kv_heads=1, router=dict(top_k=4)), "Qwen2MoeForCausalLM"),
    "qwen2_moe_odd_sizes": (dict(d_model=30, num_heads=3, num_kv_heads=3, expert_hidden=11, shared_expert_hidden=7,
                                 shared_expert_gate=True, dense_hidden=19, dense_layers=[1]), "Qwen2MoeForCausalLM"),
    "qwen2_moe_heads_not_dividing_odd": (dict(d_model=27, num_heads=4, num_kv_heads=2, head_dim=6, num_layers=1,
                                              expert_hidden=8), "Qwen2MoeForCausalLM"),
    "qwen3_moe_heads_not_dividing_odd": (dict(qk_norm=True, d_model=27, num_heads=4, num_kv_heads=2, head_dim=6,
                                              expert_hidden=8), "Qwen3MoeForCausalLM"),
    # sigmoid: GLM-4-MoE
    "glm4_moe_full": (dict(qk_norm=True, attention_bias=True, rotary_fraction=0.5, shared_expert_hidden=16,
                           dense_layers=[0], num_layers=3, router=dict(SIG, expert_bias=True, routed_scaling_factor=2.5)),
                      "Glm4MoeForCausalLM"),
    "glm4_moe_plain": (dict(router=dict(SIG)), "Glm4MoeForCausalLM"),
    "glm4_moe_topk_all_no_renorm_tied": (dict(tie_embeddings=True, router=dict(SIG, top_k=4, normalize_top_k=False,
                                                                               expert_bias=True)),
                                         "Glm4MoeForCausalLM"),
    "glm4_moe_two_shared_quarter_rotary": (dict(head_dim=16, rotary_fraction=0.25, shared_expert_hidden=32,
                                                dense_layers=[0, 1], num_layers=3, num_kv_heads=1,
                                                router=dict(SIG, routed_scaling_factor=0.7)), "Glm4MoeForCausalLM"),
    "glm4_moe_heads_not_dividing_odd": (dict(d_model=27, num_heads=4, num_kv_heads=4, head_dim=6, expert_hidden=8,
                                             rotary_fraction=1 / 3, router=dict(SIG)), "Glm4MoeForCausalLM"),
    "glm4_moe_two_experts_odd": (dict(d_model=30, num_heads=3, num_kv_heads=3, num_experts=2, expert_hidden=9,
                                      shared_expert_hidden=9, router=dict(SIG, top_k=1, expert_bias=True)),
                                 "Glm4MoeForCausalLM"),
}


def make_model(overrides: dict) -> Transformer:
    return random_model(BASE, overrides, seed=61)


@pytest.mark.parametrize("case", list(CASES))
def test_every_exported_option_computes_our_function_in_transformers_and_imports_bit_exactly(case, tmp_path):
    overrides, arch = CASES[case]
    model = make_model(overrides)
    out = tmp_path / "hf"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = export_hf(model, out, dtype="fp32")
    assert summary.architecture == arch
    # Odd sizes: the export warns that transformers' default MoE kernel (grouped_mm) needs 16-byte rows; such a
    # folder is loaded as the warning says. Every other folder loads with transformers' defaults.
    unaligned = any("multiple of 16 bytes" in str(w.message) for w in caught)
    assert unaligned == ("odd" in case)
    kwargs = {"experts_implementation": "eager"} if unaligned else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, **kwargs).eval()
    assert type(hf).__name__ == arch
    ids = torch.randint(0, model.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids)[0], hf(ids).logits
    assert (ours - theirs).abs().max().item() < 2e-5, (ours - theirs).abs().max().item()

    prompt = ids[:1, :5]
    with torch.no_grad():
        generated = hf.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(generated, our_greedy(model, prompt, 6))

    cfg, state = import_hf(out)
    assert cfg.model == model.cfg or _same_function_fields(cfg.model, model.cfg)
    ref = model.state_dict()
    assert set(state) == set(ref)
    for name, t in ref.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], t), name


def _same_function_fields(a: ModelConfig, b: ModelConfig) -> bool:
    """Imported vs ours, ignoring the training-only router fields an HF config does not carry."""
    ra, rb = a.router, b.router
    fields = ("gating", "top_k", "normalize_top_k", "expert_bias", "routed_scaling_factor")
    same_router = all(getattr(ra, f) == getattr(rb, f) for f in fields) if b.num_experts else True
    keep = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "resolved_head_dim", "qk_norm",
            "attention_bias", "rope_theta", "rotary_fraction", "norm_eps", "dense_hidden", "num_experts",
            "shared_expert_hidden", "shared_expert_gate", "tie_embeddings")
    moe_only = ("dense_layers", "expert_hidden") if b.num_experts else ()
    diffs = [f for f in keep + moe_only if getattr(a, f) != getattr(b, f)]
    assert not diffs and same_router, (diffs, ra, rb)
    return True
