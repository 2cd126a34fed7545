"""model.sliding_window_pattern in the Hugging Face export and import, at the config.json level.

A window w: the query and the w - 1 keys before it (Hugging Face's sliding_window); 0 = full causal attention.
Stock classes get it where they compute exactly our per-layer windows with every attention implementation (Qwen3:
layer_types + one sliding_window; Qwen3-MoE: every layer or none), the others are refused naming the field and the
custom-code remedy: Qwen2-MoE too, whose config has windows but whose attention passes none to flash attention.
Custom code carries any pattern. Import maps what transformers' config classes compute back to a pattern, Qwen2-MoE's
windows included (its eager and sdpa attention compute them).
The logits of these folders in transformers: packages/moe-train/tests/test_hf_sliding_window.py.
"""

from __future__ import annotations

import copy
import re

import pytest
from ckpt_cases import HF_MODEL, HF_ROUTER

from moe_ckpt.hf import HFConversionError, choose_model_type, from_hf_config, to_hf_config
from moe_ckpt.hf.custom_code import from_custom_config, to_custom_config
from moe_ckpt.hf.windows import hf_layer_windows, layer_windows, pattern_of

ROUTER = HF_ROUTER
# moe-train's ModelConfig as a dict (Config.to_dict()["model"]), 8 layers.
MODEL = {**HF_MODEL, "num_layers": 8}
# model type -> the fields that choose it
SHAPES = {
    "qwen3": dict(num_experts=0, qk_norm=True),
    "llama": dict(num_experts=0, qk_norm=False),
    "qwen3_moe": dict(qk_norm=True),
    "qwen2_moe": dict(qk_norm=False, shared_expert_hidden=16),
    "glm4_moe": dict(qk_norm=True, router={**ROUTER, "gating": "sigmoid", "expert_bias": True}),
}
OLMO3 = [4096, 4096, 4096, 0]


def model(model_type: str, pattern: list[int] | None, **kw) -> dict:
    """A model dict of SHAPES[model_type] + kw; pattern None: without the key (a dict written before it existed)."""
    m = copy.deepcopy({**MODEL, **SHAPES[model_type], **kw})
    if pattern is None:
        del m["sliding_window_pattern"]
    else:
        m["sliding_window_pattern"] = pattern
    return m


def export_config(m: dict) -> dict:
    return to_hf_config(m, choose_model_type(m), "fp32")


def test_layer_windows_cycle_the_pattern_and_a_dict_without_it_has_none():
    assert layer_windows(model("qwen3", OLMO3)) == OLMO3 * 2
    assert layer_windows(model("qwen3", [5, 0, 16])) == [5, 0, 16, 5, 0, 16, 5, 0]
    assert layer_windows(model("qwen3", [])) == layer_windows(model("qwen3", None)) == [0] * 8
    for bad in ([-1], [4.0], [True], "16"):
        with pytest.raises(HFConversionError, match=r"model\.sliding_window_pattern=.*expected a list of integers"):
            layer_windows(model("qwen3", bad))


def test_pattern_of_is_the_shortest_cycle():
    assert pattern_of([0] * 8) == [] and pattern_of([]) == []
    assert pattern_of(OLMO3 * 2) == OLMO3
    assert pattern_of([7] * 5) == [7]
    assert pattern_of([5, 0, 5]) == [5, 0]  # [5, 0] cycled over 3 layers
    assert pattern_of([5, 0, 0]) == [5, 0, 0]


def test_qwen3_writes_layer_types_and_one_sliding_window():
    c = export_config(model("qwen3", OLMO3))
    assert c["model_type"] == "qwen3"
    assert c["use_sliding_window"] is True and c["sliding_window"] == 4096
    assert c["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + [
        "full_attention"]


def test_max_window_layers_is_written_only_where_it_derives_the_same_layers():
    """transformers 5 reads layer_types; max_window_layers as the class would derive them is written where one
    value does (Qwen3: the layers from it on)."""
    assert export_config(model("qwen3", [0, 0, 0, 0, 0, 9, 9, 9]))["max_window_layers"] == 5
    assert export_config(model("qwen3", [9]))["max_window_layers"] == 0
    assert "max_window_layers" not in export_config(model("qwen3", [9, 0]))
    assert "max_window_layers" not in export_config(model("qwen3", OLMO3))


def test_qwen2_moe_config_json_gets_no_windows_even_past_choose_model_type():
    """to_hf_config, given qwen2_moe without choose_model_type's refusal, writes no layer_types or sliding_window for
    a windowed model: it refuses, naming the class."""
    with pytest.raises(HFConversionError, match=r"Qwen2MoeForCausalLM is not exported with sliding windows"):
        to_hf_config(model("qwen2_moe", [0, 5]), "qwen2_moe", "fp32")
    assert export_config(model("qwen2_moe", []))["use_sliding_window"] is False


def test_qwen3_moe_writes_use_sliding_window_when_every_layer_has_the_one_window():
    c = export_config(model("qwen3_moe", [16, 16]))
    assert c["use_sliding_window"] is True and c["sliding_window"] == 16 and "layer_types" not in c


@pytest.mark.parametrize("model_type", list(SHAPES))
@pytest.mark.parametrize("pattern", [None, [], [0], [0, 0]])
def test_full_attention_exports_as_before_the_field(model_type, pattern):
    """A dict without the key, [] and all-zero patterns: the config.json of a model without windows."""
    c = export_config(model(model_type, pattern))
    assert c == export_config(model(model_type, None))
    assert not c.get("use_sliding_window") and "layer_types" not in c and not c.get("sliding_window")


@pytest.mark.parametrize("model_type, pattern, why", [
    ("llama", OLMO3, r"LlamaForCausalLM has no sliding-window attention"),
    ("glm4_moe", [16], r"Glm4MoeForCausalLM has no sliding-window attention"),
    ("qwen3", [5, 16, 0], r"windows of 2 sizes \[5, 16\] \(Qwen3ForCausalLM has one sliding_window"),
    # Qwen2-MoE: its config and masks have windows, its flash-attention path drops them
    ("qwen2_moe", OLMO3, r"\(Qwen2MoeAttention passes no sliding_window to flash attention, so that path attends to "
                         r"the whole prefix"),
    ("qwen2_moe", [0, 5], r"Qwen2MoeAttention passes no sliding_window to flash attention"),
    ("qwen2_moe", [16], r"Qwen2MoeAttention passes no sliding_window to flash attention"),
    ("qwen2_moe", [1, 5], r"Qwen2MoeAttention passes no sliding_window to flash attention"),
    ("qwen3_moe", OLMO3, r"not one window in every layer \(Qwen3MoeForCausalLM windows every layer"),
    ("qwen3_moe", [5, 16], r"not one window in every layer"),
])
def test_a_pattern_no_stock_class_computes_is_refused_naming_it_and_the_custom_code_remedy(model_type, pattern, why):
    m = model(model_type, pattern)
    with pytest.raises(HFConversionError) as refusal:
        choose_model_type(m)
    message = str(refusal.value)
    assert f"sliding_window_pattern={pattern!r}" in message
    assert re.search(why, message), message
    assert "nearest that exports" in message and "custom_code=True" in message and "trust_remote_code" in message
    assert choose_model_type(m, custom_code=True) == "moe_train"


def test_custom_code_carries_any_pattern_and_an_old_folder_imports_full_attention():
    m = model("qwen3_moe", [1, 5, 0, 16], shared_expert_hidden=16)  # no stock class: softmax + shared + qk_norm
    c = to_custom_config(m, "fp32")
    assert c["moe_train_model"]["sliding_window_pattern"] == [1, 5, 0, 16]
    assert "sliding_window" not in c and "layer_types" not in c  # transformers' caches would drop keys
    assert from_custom_config(c)[0]["sliding_window_pattern"] == [1, 5, 0, 16]
    old = to_custom_config(model("qwen3_moe", None, shared_expert_hidden=16), "fp32")
    assert "sliding_window_pattern" not in old["moe_train_model"]
    # import_hf lays the dict over a base config: the base's windows must not survive
    assert from_custom_config(old)[0]["sliding_window_pattern"] == []


@pytest.mark.parametrize("model_type, pattern", [
    ("qwen3", OLMO3), ("qwen3", [0, 3]), ("qwen3", [1]), ("qwen3", [5, 0, 0]), ("qwen3", []),
    ("qwen2_moe", []),
    ("qwen3_moe", [16]), ("qwen3_moe", []), ("llama", []), ("glm4_moe", []),
])
def test_export_then_import_keeps_each_layers_window(model_type, pattern):
    m = model(model_type, pattern)
    back = from_hf_config(export_config(m))[0]
    assert layer_windows(back) == layer_windows(m)
    assert back["sliding_window_pattern"] == pattern_of(layer_windows(m))


HF = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts_per_tok=2, num_experts=4)
SW, FA = "sliding_attention", "full_attention"


@pytest.mark.parametrize("config, pattern", [
    # Qwen3: layer_types, else the layers from max_window_layers on (class default 28), window default 4096
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=8, layer_types=[SW, SW, SW, FA]), [8, 8, 8, 0]),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=2), [0, 0, 8, 8]),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=8), []),
    (dict(model_type="qwen3", use_sliding_window=True, max_window_layers=0), [4096]),
    (dict(model_type="qwen3", use_sliding_window=False, sliding_window=8, max_window_layers=0), []),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=8, layer_types=["attention"] * 4), []),
    # Qwen2-MoE: layer_types, else the even layers below max_window_layers (default 28)
    (dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=6), [6, 0]),
    (dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=6, max_window_layers=1), [6, 0, 0, 0]),
    (dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=6, layer_types=[FA, SW, SW, SW]),
     [0, 6, 6, 6]),
    (dict(model_type="qwen2_moe", use_sliding_window=False, sliding_window=6), []),
    # Qwen3-MoE: every layer, or none
    (dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=3), [3]),
    (dict(model_type="qwen3_moe", use_sliding_window=True), [4096]),
    (dict(model_type="qwen3_moe", use_sliding_window=False, sliding_window=3), []),
    (dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=None), []),
    (dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=3, layer_types=[SW] * 4), [3]),
    (dict(model_type="llama", sliding_window=3, layer_types=[FA] * 4), []),
])
def test_import_maps_what_transformers_computes_to_a_pattern(config, pattern):
    assert from_hf_config({**HF, **config})[0]["sliding_window_pattern"] == pattern


@pytest.mark.parametrize("config, message", [
    # a sliding layer whose window is None (Qwen3) or 0 (Qwen2-MoE): transformers fails or attends to nothing
    (dict(model_type="qwen3", layer_types=[FA, SW, FA, FA]),
     r"config\.json layer_types=\[.*\]: expected only 'full_attention' where use_sliding_window=false "
     r"\(Qwen3ForCausalLM's sliding_window is then None"),
    (dict(model_type="qwen2_moe", sliding_window=6, layer_types=[SW] * 4),
     r"config\.json layer_types=.*Qwen2MoeForCausalLM's sliding_window is then 0"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=None, layer_types=[SW] * 4),
     r"config\.json sliding_window=None: expected an integer >= 1"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=0, layer_types=[SW] * 4),
     r"config\.json sliding_window=0: expected an integer >= 1"),
    (dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=2.5),
     r"config\.json sliding_window=2\.5: expected an integer >= 1"),
    (dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=None, layer_types=[FA] * 4),
     r"config\.json sliding_window=None: expected an integer >= 1 \(Qwen2MoeForCausalLM builds its sliding-window "
     r"mask whenever use_sliding_window is true\)"),
    # what transformers would compute otherwise than the key says, or refuse
    (dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=3, layer_types=[SW, FA, SW, FA]),
     r"config\.json layer_types=.*expected only 'sliding_attention'.*Qwen3MoeForCausalLM reads no layer_types"),
    (dict(model_type="qwen3_moe", layer_types=[SW] * 4), r"config\.json layer_types=.*expected only 'full_attention'"),
    (dict(model_type="qwen3", use_sliding_window=True, layer_types=[SW] * 3),
     r"config\.json layer_types=.*expected a list of num_hidden_layers=4 entries"),
    (dict(model_type="qwen3", use_sliding_window=True, layer_types=["chunked_attention"] * 4),
     r"config\.json layer_types=.*expected a list of num_hidden_layers=4 entries"),
    (dict(model_type="qwen3", use_sliding_window=True, max_window_layers=None),
     r"config\.json max_window_layers=None: expected an integer"),
    # no sliding windows in the class
    (dict(model_type="llama", use_sliding_window=True),
     r"config\.json use_sliding_window=True: expected false \(LlamaForCausalLM has no sliding-window attention\)"),
    (dict(model_type="glm4_moe", n_routed_experts=4, layer_types=[SW] * 4),
     r"config\.json layer_types=.*expected only 'full_attention' \(Glm4MoeForCausalLM has no sliding-window"),
])
def test_import_refuses_windows_it_cannot_represent_naming_the_key(config, message):
    with pytest.raises(HFConversionError, match=message):
        from_hf_config({**HF, **config})


@pytest.mark.parametrize("model_type, pattern", [
    ("qwen3", OLMO3), ("qwen3", [0, 0, 0, 0, 0, 9, 9, 9]), ("qwen3", [1]), ("qwen3_moe", [16]),
])
def test_transformers_config_classes_compute_our_windows_from_the_export(model_type, pattern):
    """transformers' own config class, built from our config.json: its layer_types and sliding_window are our
    windows, and its to_dict() (what save_pretrained writes) imports back to them."""
    transformers = pytest.importorskip("transformers")
    m = model(model_type, pattern)
    c = export_config(m)
    hf = transformers.AutoConfig.for_model(**{k: v for k, v in c.items() if k != "model_type"}, model_type=model_type)
    windows = layer_windows(m)
    if model_type == "qwen3_moe":
        assert hf.sliding_window == pattern[0] and not hasattr(hf, "layer_types")
    else:
        assert hf.sliding_window == max(windows)
        assert hf.layer_types == [SW if w else FA for w in windows]
    assert hf_layer_windows(hf.to_dict()) == windows
    # without layer_types, where max_window_layers was written, the class derives the same layers
    if "max_window_layers" in c:
        c.pop("layer_types")
        hf = transformers.AutoConfig.for_model(**{k: v for k, v in c.items() if k != "model_type"},
                                               model_type=model_type)
        assert hf.layer_types == [SW if w else FA for w in windows]


@pytest.mark.parametrize("config, windows", [
    (dict(use_sliding_window=True, sliding_window=6), [6, 0, 6, 0]),  # the even layers below max_window_layers=28
    (dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), [6, 0, 0, 0]),
    (dict(use_sliding_window=True, max_window_layers=3), [4096, 0, 4096, 0]),  # the class's window
    (dict(use_sliding_window=True, sliding_window=6, layer_types=[FA, SW, FA, SW]), [0, 6, 0, 6]),
    (dict(use_sliding_window=True, sliding_window=5, layer_types=[SW] * 4), [5, 5, 5, 5]),
    (dict(use_sliding_window=True, sliding_window=6, layer_types=[FA] * 4), [0, 0, 0, 0]),
    (dict(use_sliding_window=False, sliding_window=6), [0, 0, 0, 0]),
])
def test_transformers_qwen2_moe_config_computes_the_windows_we_import(config, windows):
    """Qwen2-MoE's windows are imported (not exported): transformers' Qwen2MoeConfig, built from a hand-written
    config.json, has the layer_types and sliding_window whose windows hf_layer_windows gives, from the dict and from
    the class's to_dict() (what save_pretrained writes)."""
    transformers = pytest.importorskip("transformers")
    c = {**HF, **config}
    hf = transformers.AutoConfig.for_model("qwen2_moe", **c)
    assert type(hf).__name__ == "Qwen2MoeConfig"
    assert [hf.sliding_window if t == SW else 0 for t in hf.layer_types] == windows
    assert hf_layer_windows({**c, "model_type": "qwen2_moe"}) == windows
    assert hf_layer_windows(hf.to_dict()) == windows
    assert from_hf_config({**c, "model_type": "qwen2_moe"})[0]["sliding_window_pattern"] == pattern_of(windows)
