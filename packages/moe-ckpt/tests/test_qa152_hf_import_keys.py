"""QA 152 (review helper 171): import's refusals name the config.json key the folder holds. num_experts_per_tok past
the routed experts (or below 1) was refused by moe-train as "model.router.top_k=9: expected 1 <= top_k <=
model.num_experts=8", a field the user of import-hf never set."""

from __future__ import annotations

import copy

import pytest
from moe_ckpt.hf import HFConversionError, from_hf_config, to_hf_config

ROUTER = dict(gating="softmax", top_k=2, normalize_top_k=True, routing="learned", lb_loss_weight=0.01,
              lb_loss_scope="micro_batch", z_loss_weight=0.001, expert_bias=False, expert_bias_rate=0.001,
              routed_scaling_factor=1.0)
MODEL = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=None, qk_norm=True,
             attention_bias=False, rope_theta=1000.0, rotary_fraction=1.0, sliding_window_pattern=[], norm_eps=1e-6,
             dense_hidden=48, dense_layers=[], num_experts=4, expert_hidden=16, shared_expert_hidden=0,
             shared_expert_gate=False, router=ROUTER, tie_embeddings=False, init_std=0.02, gemm_backend="auto",
             precision="bf16")
GLM = dict(router={**ROUTER, "gating": "sigmoid", "expert_bias": True}, shared_expert_hidden=16)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe"])
@pytest.mark.parametrize("top_k", [0, 5, -1, 2.0, True])
def test_a_top_k_outside_the_experts_is_refused_naming_num_experts_per_tok(model_type, top_k):
    m = copy.deepcopy({**MODEL, **(GLM if model_type == "glm4_moe" else {})})
    c = to_hf_config(m, model_type, "bf16")
    assert from_hf_config(c)[0]["router"]["top_k"] == 2  # the unedited config imports
    c["num_experts_per_tok"] = top_k
    with pytest.raises(HFConversionError, match=rf"config.json num_experts_per_tok={top_k!r}: expected an integer "
                                                r"from 1 to the 4 routed experts"):
        from_hf_config(c)
