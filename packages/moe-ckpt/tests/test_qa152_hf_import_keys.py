"""QA 152 (review helper 171): import's refusals name the config.json key the folder holds. num_experts_per_tok past
the routed experts (or below 1) was refused by moe-train as "model.router.top_k=9: expected 1 <= top_k <=
model.num_experts=8", a field the user of import-hf never set."""

from __future__ import annotations

import copy

import pytest
from ckpt_cases import HF_MODEL as MODEL
from ckpt_cases import HF_ROUTER as ROUTER
from moe_ckpt.hf import HFConversionError, from_hf_config, to_hf_config

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
