"""QA 94: Hugging Face import fuzzed against transformers itself.

1,200 random tiny folders (seeds 0-599, twice), 240 per model_type (llama, qwen3, qwen3_moe, qwen2_moe, glm4_moe),
each drawn with transformers' own config class (hidden_act, rope_parameters of every type, partial_rotary_factor,
head_dim, attention / qkv / mlp biases, tied embeddings, rms_norm_eps, norm_topk_prob, decoder_sparse_step,
mlp_only_layers, first_k_dense_replace, n_group / topk_group, routed_scaling_factor, shared experts, use_qk_norm,
sliding_window / use_sliding_window / max_window_layers / layer_types, top-k up to all experts, pretraining_tp), every
weight, norm, bias and e_score_correction_bias random, saved with save_pretrained; the second 600 with config.json
then edited as older or hand-written folders are (keys left out, transformers-4 rope keys, rope_scaling, layer_types
added). import_hf's model against transformers' fp32 logits at 1, 7 and 19 tokens.
No import gave other logits: after the fixes 445 imported and matched (<= 4.5e-7 relative), 711 were refused naming
a config.json key or tensor, 36 transformers itself refused to build, 2 ran into a transformers bug (an all-dense
Qwen2-MoE with output_router_logits), and 6 imported folders transformers refuses to load (below). Defects, each
checked here (8 checks fail on the code before):
- mlp_only_layers naming a layer past the last (transformers ignores it) and first_k_dense_replace past
  num_hidden_layers (every layer dense) were refused as moe-train's ConfigError on model.dense_layers: now imported;
- a Qwen2-MoE / Qwen3-MoE config.json without num_experts crashed with a TypeError: now the class default (60 / 128),
  refused naming the router tensor's shape;
- layer_types with 'sliding_attention' (Qwen3, Qwen2-MoE), a GLM-4-MoE with one routed expert and an odd head_dim
  (Qwen2-MoE's hidden_size // num_heads) imported, or failed as a ConfigError, though transformers fails on them in
  its first forward: now each is refused naming the key.
Left as it was: a config.json without num_key_value_heads imports as num_attention_heads (Llama's default), where
Qwen3 / Qwen3-MoE / Qwen2-MoE / GLM-4-MoE default to 32 / 4 / 16 / 8 and transformers refuses the folder's k_proj
shape. Some refusals are stricter than transformers (hidden_act='swish' is silu; Qwen2-MoE's shared_expert_gate
without a shared expert multiplies zeros).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_ckpt.hf import HFConversionError
from moe_train.hf_bridge import import_hf

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_home, hf_logits, one_thread, our_logits  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.usefixtures("hf_home")

SIZES = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, intermediate_size=24, initializer_range=0.1)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=8)
ROPE = {"rope_type": "default", "rope_theta": 1000.0}
CLASSES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
           "qwen2_moe": "Qwen2MoeConfig", "glm4_moe": "Glm4MoeConfig"}


def save_random(tmp_path: Path, model_type: str, seed: int = 0, **kw) -> Path:
    """A tiny transformers model of the class's config (SIZES + kw; None leaves a key out), every tensor random,
    saved as a folder."""
    if model_type == "qwen2_moe":
        kw.setdefault("shared_expert_intermediate_size", 8)  # the class default is 5632
    kw = {k: v for k, v in {**SIZES, "rope_parameters": dict(ROPE), **kw}.items() if v is not None}
    cfg = getattr(transformers, CLASSES[model_type])(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("o_proj.bias"):  # moe-train has none there (a non-zero one is refused)
                t.zero_()
            elif name.endswith("norm.weight"):
                t.copy_(1.0 + 0.3 * torch.randn_like(t))
            elif name.endswith((".bias", "e_score_correction_bias")):
                t.copy_(0.2 * torch.randn_like(t))
            else:
                t.copy_(0.1 * torch.randn_like(t))
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    """config.json edited as a hand-written folder's: a None value removes the key."""
    path = folder / "config.json"
    c = json.loads(path.read_text())
    c.update(changes)
    path.write_text(json.dumps({k: v for k, v in c.items() if v is not None}))


def assert_imports_exactly(folder: Path) -> None:
    cfg, state = import_hf(folder)
    for seq in (1, 7, 19):
        ids = torch.randint(0, SIZES["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seq))
        torch.testing.assert_close(our_logits(cfg.model, state, ids), hf_logits(folder, ids), rtol=1e-5, atol=1e-5)


# Representative of the fuzz's imports that held.
HELD = {
    "llama_attention_bias_tied": ("llama", dict(attention_bias=True, tie_word_embeddings=True, rms_norm_eps=0.3)),
    "qwen3_gqa_head_dim": ("qwen3", dict(head_dim=16, attention_bias=True, layer_types=["full_attention"] * 2)),
    "qwen3_moe_all_experts_dense_first": ("qwen3_moe", dict(MOE, num_experts=4, num_experts_per_tok=4,
                                                            norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen2_moe_gated_shared": ("qwen2_moe", dict(MOE, num_experts=4, shared_expert_intermediate_size=12,
                                                 qkv_bias=True)),
    "glm4_moe_partial_rotary_scaled": ("glm4_moe", dict(MOE, n_routed_experts=4, n_shared_experts=2, use_qk_norm=True,
                                                        attention_bias=True, routed_scaling_factor=2.5,
                                                        first_k_dense_replace=1, partial_rotary_factor=0.25,
                                                        rope_parameters={**ROPE, "partial_rotary_factor": 0.25})),
    # Defects: refused as moe-train's ConfigError on model.dense_layers, though transformers computes them.
    "qwen3_moe_mlp_only_layers_past_the_last": ("qwen3_moe", dict(MOE, num_experts=4, num_hidden_layers=3,
                                                                  mlp_only_layers=[1, 3])),
    "qwen2_moe_mlp_only_layers_past_the_last": ("qwen2_moe", dict(MOE, num_experts=4, mlp_only_layers=[2, 5])),
    "glm4_moe_first_k_dense_past_the_last": ("glm4_moe", dict(MOE, n_routed_experts=4, first_k_dense_replace=3)),
    # Refused before moe-ckpt 0.21.6 (review helper 151), though model.dense_layers holds the layout: layer i is
    # sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (layer 1 of 0-4 here; layer 2 of
    # 0-3 in the second)
    "qwen3_moe_decoder_sparse_step_2": ("qwen3_moe", dict(MOE, num_experts=4, num_hidden_layers=5,
                                                          decoder_sparse_step=2, mlp_only_layers=[3])),
    "qwen2_moe_decoder_sparse_step_3": ("qwen2_moe", dict(MOE, num_experts=4, num_hidden_layers=4,
                                                          decoder_sparse_step=3)),
}


@pytest.mark.parametrize("name", HELD)
def test_import_matches_transformers_logits(tmp_path, name):
    model_type, kw = HELD[name]
    assert_imports_exactly(save_random(tmp_path, model_type, **kw))


@pytest.mark.parametrize("vocab", ["61", True, 0])
def test_a_vocab_size_that_is_not_a_positive_integer_is_refused_naming_it(tmp_path, vocab):
    """0.21.8 checked the token ids against vocab_size before vocab_size itself: "61" ended in a TypeError, true
    blamed bos_token_id (review helper 157)."""
    folder = save_random(tmp_path, "llama")
    edit_config(folder, vocab_size=vocab)
    with pytest.raises(HFConversionError, match=f"config.json vocab_size={vocab!r}: expected an integer >= 1"):
        import_hf(folder)


@pytest.mark.parametrize("step", [0, -1, 1.5, True])
def test_a_decoder_sparse_step_that_is_not_a_positive_integer_is_refused_naming_it(tmp_path, step):
    folder = save_random(tmp_path, "qwen3_moe", **MOE, num_experts=4)
    edit_config(folder, decoder_sparse_step=step)  # transformers cannot build these (0: modulo by zero)
    with pytest.raises(HFConversionError, match=f"config.json decoder_sparse_step={step!r}: expected an integer >= 1"):
        import_hf(folder)


def test_a_folder_with_both_layouts_imports_the_single_file_transformers_loads(tmp_path):
    """model.safetensors beside a sharded save of other weights: moe-ckpt <= 0.21.7 read the index's shards, so the
    import computed another model than the one transformers loads from the same folder (review helper 155)."""
    folder = save_random(tmp_path / "single", "llama", seed=0)
    sharded = save_random(tmp_path / "sharded", "llama", seed=1)
    transformers.AutoModelForCausalLM.from_pretrained(sharded).save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    for name in shards + ["model.safetensors.index.json"]:
        (folder / name).write_bytes((sharded / name).read_bytes())
    with pytest.warns(UserWarning, match="holds both model.safetensors and model.safetensors.index.json: reading "
                                         "model.safetensors, the one transformers loads"):
        assert_imports_exactly(folder)



def test_an_index_that_names_only_model_safetensors_beside_it_imports_without_a_warning(tmp_path):
    """One layout described twice: 0.21.8 warned that the folder held both (review helper 157)."""
    folder = save_random(tmp_path, "llama")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_imports_exactly(folder)


def test_missing_num_experts_is_the_class_default_and_refused_by_tensor_shape(tmp_path):
    """Qwen2-MoE's and Qwen3-MoE's num_experts defaults to 60 / 128 in transformers; import crashed (TypeError)."""
    for model_type in ("qwen2_moe", "qwen3_moe"):
        folder = save_random(tmp_path, model_type, **MOE, num_experts=4)
        edit_config(folder, num_experts=None, num_local_experts=None)
        shape = r"mlp\.gate\.weight has shape \[4, 32\], expected \[(60|128), 32\]"
        with pytest.raises(HFConversionError, match=shape):
            import_hf(folder)


# Folders transformers builds and saves but fails on in its first forward: imported (or a ConfigError) before.
REFUSED = {
    "qwen3_sliding_layer_types": ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    "qwen2_moe_sliding_layer_types": ("qwen2_moe", dict(MOE, num_experts=4, layer_types=["sliding_attention"] * 2),
                                      "layer_types"),
    "glm4_moe_one_routed_expert": ("glm4_moe", dict(MOE, n_routed_experts=1, num_experts_per_tok=1),
                                   "n_routed_experts=1"),
    "qwen2_moe_odd_head_dim": ("qwen2_moe", dict(MOE, num_experts=4, hidden_size=30, num_attention_heads=6,
                                                 num_key_value_heads=6, head_dim=None), "head_dim=5"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_folder_transformers_cannot_run_is_refused_naming_the_key(tmp_path, name):
    model_type, kw, key = REFUSED[name]
    folder = save_random(tmp_path, model_type, **kw)
    with pytest.raises(HFConversionError, match=f"config.json {key}"):
        import_hf(folder)


@pytest.mark.parametrize("model_type, kw, key", [
    ("llama", dict(rope_parameters={**ROPE, "rope_type": "yarn", "factor": 2.0,
                                    "original_max_position_embeddings": 32}), "rope_parameters.rope_type='yarn'"),
    ("qwen3_moe", dict(MOE, num_experts=4, hidden_act="gelu"), "hidden_act='gelu'"),
    # taken by moe-ckpt <= 0.21.7, then refused by the next export as "extra_config" (review helper 155)
    ("llama", dict(eos_token_id=99999), "eos_token_id=99999: expected null or a token id: an integer in \\[0, 61\\)"),
    ("qwen3", dict(pad_token_id=-2), "pad_token_id=-2: expected null or a token id"),
    ("glm4_moe", dict(MOE, n_routed_experts=4, n_group=2, topk_group=1), "n_group=2"),
])
def test_uncomputed_key_refused_naming_it(tmp_path, model_type, kw, key):
    with pytest.raises(HFConversionError, match=f"config.json {key}"):
        import_hf(save_random(tmp_path, model_type, **kw))
