"""QA 95: random COMBINATIONS of every model option, exported to Hugging Face and run by transformers itself.

QA 61 (test_qa61_hf_sweep.py) tried each option alone. QA 95 drew 2,870 valid random tiny configs (d_model 16-48,
1-3 layers, vocab 50-100; heads / kv heads / head_dim override, qk_norm, attention_bias, rotary_fraction, rope_theta
1 to 1e9, norm_eps 1e-12 to 1, tie_embeddings, 0-9 experts, top_k 1..E, softmax / sigmoid, normalize_top_k,
expert_bias, routed_scaling_factor, dense_layers, shared expert with and without its gate, dense / expert widths,
init_std), every tensor random, and exported each with `export_hf` in fp32 (299 also in bf16 and fp16, 200 in
3,000-byte shards) to transformers 5.24:

- stock (custom_code=False): 2,105 loaded as Llama / Qwen3 / Qwen3-MoE / Qwen2-MoE / GLM-4-MoE (412 / 401 / 348 /
  338 / 606) with logits equal to ours within 2.8e-6 on lengths 1, 5 and 17 (120 also at 700), greedy generation
  through the KV cache and a left-padded row equal to ours, `import_hf` giving back every tensor bit-exact; 765
  refused naming the field; none loaded with other logits, none failed to load or import;
- custom code (trust_remote_code=True): all 2,870 loaded and matched (within 1.6e-6), and imported bit-exact;
- a further 120 left-padded batched `generate` calls, stock and custom code, gave our greedy tokens per row.

No defect found. Kept here: a few of the fuzzed combinations that touch the most mappings at once.
Noticed and left alone: a model with num_experts > 0 whose every layer is in dense_layers computes a dense model, yet
the stock export refuses it for its unused router / shared-expert / rotary fields (91 of the 765 refusals); the
refusal names the field and custom_code=True exports it.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_ckpt.hf import HFConversionError
from moe_train.hf_bridge import export_hf, import_hf

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_home, one_thread, random_model, transformers  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.usefixtures("hf_home")

BASE = dict(vocab_size=61, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden=24, num_experts=4,
            expert_hidden=8, init_std=0.2, rope_theta=500.0, norm_eps=1e-5)
SIG = dict(gating="sigmoid")

# name -> (ModelConfig overrides, the stock class, or None where the stock export refuses naming this field)
CASES = {
    "glm4_moe_everything": (dict(qk_norm=True, attention_bias=True, rotary_fraction=0.25, head_dim=16, num_heads=3,
                                 num_kv_heads=1, tie_embeddings=True, num_experts=9, shared_expert_hidden=16,
                                 dense_layers=[0], norm_eps=0.37, rope_theta=3.3,
                                 router=dict(SIG, top_k=9, normalize_top_k=False, expert_bias=True,
                                             routed_scaling_factor=0.7)), "Glm4MoeForCausalLM"),
    "glm4_moe_all_dense_layers": (dict(num_experts=2, dense_layers=[0, 1, 2], router=dict(SIG, top_k=1)),
                                  "Glm4MoeForCausalLM"),
    "qwen2_moe_gated_bias_mqa_mixed": (dict(attention_bias=True, head_dim=8, num_kv_heads=1, num_experts=5,
                                            shared_expert_hidden=24, shared_expert_gate=True, dense_layers=[1],
                                            rope_theta=1e9, router=dict(top_k=3, normalize_top_k=False)),
                                       "Qwen2MoeForCausalLM"),
    "qwen3_moe_tied_bias_one_expert": (dict(qk_norm=True, attention_bias=True, tie_embeddings=True, num_experts=1,
                                            num_layers=2, dense_layers=[1], router=dict(top_k=1)),
                                       "Qwen3MoeForCausalLM"),
    "qwen3_heads_not_dividing_unused_moe_fields": (dict(qk_norm=True, num_experts=0, d_model=30, num_heads=4,
                                                        head_dim=8, shared_expert_hidden=8, norm_eps=1e-12,
                                                        router=dict(SIG, expert_bias=True)), "Qwen3ForCausalLM"),
    "llama_mha_bias_tied": (dict(num_experts=0, num_kv_heads=4, attention_bias=True, tie_embeddings=True,
                                 rope_theta=1.0), "LlamaForCausalLM"),
    # softmax + shared expert + qk_norm + routed scaling + partial rotary: custom code only
    "custom_code_only": (dict(qk_norm=True, rotary_fraction=0.5, shared_expert_hidden=12, shared_expert_gate=True,
                              router=dict(top_k=2, routed_scaling_factor=2.5)), None),
}


def _logits_match(model, folder: Path, **load) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **load).eval()
    gen = torch.Generator().manual_seed(95)
    for length in (1, 5, 17):
        ids = torch.randint(0, model.cfg.vocab_size, (2, length), generator=gen)
        with torch.no_grad():
            ours, theirs = model(ids)[0], hf(ids).logits
        assert (ours - theirs).abs().max().item() < 1e-5, (length, (ours - theirs).abs().max().item())


def _imports_bit_exactly(model, folder: Path) -> None:
    _, state = import_hf(folder)
    ref = model.state_dict()
    assert set(state) == set(ref)
    for name, t in ref.items():
        assert torch.equal(state[name], t), name


@pytest.mark.parametrize("case", list(CASES))
def test_option_combinations_compute_our_logits_in_transformers_stock_and_custom_code(case, tmp_path):
    overrides, arch = CASES[case]
    model = random_model(BASE, overrides, seed=95)
    stock = tmp_path / "stock"
    if arch is None:
        refused = r"router\.routed_scaling_factor=2\.5 .*no stock transformers class"
        with pytest.raises(HFConversionError, match=refused):
            export_hf(model, stock, dtype="fp32")
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert export_hf(model, stock, dtype="fp32").architecture == arch
        unaligned = any("multiple of 16 bytes" in str(w.message) for w in caught)
        _logits_match(model, stock, **({"experts_implementation": "eager"} if unaligned else {}))
        _imports_bit_exactly(model, stock)
    custom = tmp_path / "custom"
    export_hf(model, custom, dtype="fp32", custom_code=True)
    _logits_match(model, custom, trust_remote_code=True)
    _imports_bit_exactly(model, custom)
