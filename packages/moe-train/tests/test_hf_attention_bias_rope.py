"""GLM-4.5 / GLM-4.5-Air and Qwen2-MoE folders (q/k/v biases; GLM: half of each head rotated) import to our
model computing transformers' logits, and our models with model.attention_bias / model.rotary_fraction export to
folders transformers computes the same.

Before: import refused `attention_bias=True` / `qkv_bias=True` ("expected false") and
`partial_rotary_factor=0.5` ("expected 1.0"), and moe-train had neither field to train or export.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_ckpt.hf import HFConversionError, export_hf_folder, from_hf_config, open_hf_folder
from moe_train.config import Config, ModelConfig, RouterConfig, validate
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import folder_tensors, hf_logits, our_logits, one_thread  # noqa: E402,F401 - one_thread: autouse

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:export of .*no tokenizer found:UserWarning")

VOCAB, D, LAYERS, EXPERTS, HEAD_DIM = 96, 32, 3, 4, 16
GLM_SIZES = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=48, moe_intermediate_size=16,
                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                 n_routed_experts=EXPERTS, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                 norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0, initializer_range=0.1)
QWEN2_SIZES = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=48, moe_intermediate_size=16,
                   shared_expert_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
                   num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=2, mlp_only_layers=[0],
                   initializer_range=0.1)




def randomise(model: torch.nn.Module) -> None:
    """Non-zero biases and norms, and live GLM selection biases, so that a wrong mapping shows in the logits
    (transformers initialises biases to zero)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("shared_expert_gate.weight"):  # Qwen2-MoE's gate: pinned open (zero) to import
                p.zero_()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def glm45_folder(folder, config_style: str = "transformers", use_qk_norm: bool = False):
    """A tiny GLM-4-MoE with GLM-4.5's attention (attention_bias=true, partial_rotary_factor=0.5) written by
    transformers' save_pretrained. config_style: "transformers" (as transformers 5 writes it, the factor inside
    rope_parameters), "glm45" (as GLM-4.5's own config.json: top-level partial_rotary_factor and rope_theta,
    rope_scaling null) or "default" (no factor anywhere: Glm4MoeConfig's default, 0.5)."""
    cfg = transformers.Glm4MoeConfig(**GLM_SIZES, attention_bias=True, use_qk_norm=use_qk_norm,
                                     rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                      "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None and model.model.rotary_emb.inv_freq.numel() == 4
    randomise(model)
    model.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    assert written["attention_bias"] is True
    if config_style != "transformers":
        written.pop("rope_parameters", None)
        written.pop("partial_rotary_factor", None)
        written.update(rope_theta=500.0, rope_scaling=None)
        if config_style == "glm45":
            written["partial_rotary_factor"] = 0.5
        (folder / "config.json").write_text(json.dumps(written))
    return model


def qwen2_moe_folder(folder):
    """A tiny Qwen2-MoE with transformers' default qkv_bias (True), its shared-expert gate pinned open."""
    cfg = transformers.Qwen2MoeConfig(**QWEN2_SIZES, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert cfg.qkv_bias is True
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    randomise(model)
    model.save_pretrained(folder)
    return model






def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))




def check_round_trip(folder, cfg: Config, state: dict[str, torch.Tensor], ids: torch.Tensor, want: torch.Tensor,
                     tmp_path) -> float:
    """import -> export (fp32) -> transformers: the same logits; -> import again: the same config and tensors;
    the exported tensors are the folder's, bit for bit. Returns the exported folder's logit difference."""
    export_hf(tmp_path / "ours", tmp_path / "again", dtype="fp32")
    diff = (hf_logits(tmp_path / "again", ids) - want).abs().max().item()
    assert diff < 1e-4, diff
    cfg2, state2 = import_hf(tmp_path / "again")
    assert cfg2.model == cfg.model
    assert state2.keys() == state.keys() and all(torch.equal(state2[k], v) for k, v in state.items())
    native, again = folder_tensors(folder), folder_tensors(tmp_path / "again")
    assert native.keys() == again.keys() and all(torch.equal(native[k], again[k]) for k in native)
    return diff


@pytest.mark.parametrize("config_style", ["transformers", "glm45", "default"])
def test_a_glm45_folder_with_qkv_biases_and_half_rotary_imports_computing_transformers_logits(config_style,
                                                                                                tmp_path):
    folder = tmp_path / "glm45"
    glm45_folder(folder, config_style)
    cfg, state = import_hf(folder, tmp_path / "ours")
    m = cfg.model
    assert m.attention_bias is True and m.rotary_fraction == 0.5 and m.rotary_dim == HEAD_DIM // 2
    assert state["blocks.0.attn.q_proj.bias"].shape == (4 * HEAD_DIM,) and "blocks.0.attn.o_proj.bias" not in state
    ids = token_ids()
    want = hf_logits(folder, ids)
    diff = (our_logits(m, state, ids) - want).abs().max().item()
    assert diff < 1e-4, diff
    # both features are what make them agree: the same weights without either are far off
    whole_head = dataclasses.replace(m, rotary_fraction=1.0)
    assert (our_logits(whole_head, state, ids) - want).abs().max().item() > 1e-2
    unbiased = {k: torch.zeros_like(v) if k.endswith("_proj.bias") else v for k, v in state.items()}
    assert (our_logits(m, unbiased, ids) - want).abs().max().item() > 1e-2
    check_round_trip(folder, cfg, state, ids, want, tmp_path)


def test_a_glm45_folder_with_qk_norm_imports_computing_transformers_logits(tmp_path):
    """GLM-4.5 (355B) has use_qk_norm=true, GLM-4.5-Air false: the biases come before the per-head norm."""
    folder = tmp_path / "glm45"
    glm45_folder(folder, "glm45", use_qk_norm=True)
    cfg, state = import_hf(folder, tmp_path / "ours")
    assert cfg.model.qk_norm and cfg.model.attention_bias and cfg.model.rotary_fraction == 0.5
    ids = token_ids()
    want = hf_logits(folder, ids)
    diff = (our_logits(cfg.model, state, ids) - want).abs().max().item()
    assert diff < 1e-4, diff
    check_round_trip(folder, cfg, state, ids, want, tmp_path)


@pytest.mark.parametrize("key_left_out", [False, True])
def test_a_qwen2_moe_folder_with_the_default_qkv_bias_imports_computing_transformers_logits(key_left_out, tmp_path):
    """Qwen2MoeConfig's qkv_bias defaults to true; a config.json without the key (older writers) means biases."""
    folder = tmp_path / "qwen2"
    qwen2_moe_folder(folder)
    written = json.loads((folder / "config.json").read_text())
    assert written["qkv_bias"] is True
    if key_left_out:
        del written["qkv_bias"]
        (folder / "config.json").write_text(json.dumps(written))
    cfg, state = import_hf(folder, tmp_path / "ours")
    assert cfg.model.attention_bias is True and cfg.model.rotary_fraction == 1.0
    ids = token_ids()
    want = hf_logits(folder, ids)
    diff = (our_logits(cfg.model, state, ids) - want).abs().max().item()
    assert diff < 1e-4, diff
    unbiased = {k: torch.zeros_like(v) if k.endswith("_proj.bias") else v for k, v in state.items()}
    assert (our_logits(cfg.model, unbiased, ids) - want).abs().max().item() > 1e-2
    check_round_trip(folder, cfg, state, ids, want, tmp_path)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["qkv_bias"] is True


def test_a_bf16_glm45_folder_round_trips_bit_for_bit(tmp_path):
    """As GLM-4.5 ships (bf16): HF -> ours (fp32) -> HF bf16 gives the folder's tensors back, biases included
    (the selection bias, e_score_correction_bias, is written fp32 by every export of ours: the same values)."""
    folder = tmp_path / "glm45"
    glm45_folder(folder, "glm45").to(torch.bfloat16).save_pretrained(folder)
    native = folder_tensors(folder)
    assert native["model.layers.0.self_attn.q_proj.bias"].dtype == torch.bfloat16
    cfg, _ = import_hf(folder, tmp_path / "ours")
    assert cfg.model.attention_bias and cfg.model.rotary_fraction == 0.5
    export_hf(tmp_path / "ours", tmp_path / "again", dtype="bf16")
    again = folder_tensors(tmp_path / "again")
    assert native.keys() == again.keys()
    fp32 = {k for k in native if k.endswith(".e_score_correction_bias")}
    assert all(native[k].dtype == again[k].dtype and torch.equal(native[k], again[k]) for k in native.keys() - fp32)
    assert fp32 and all(torch.equal(native[k].float(), again[k]) for k in fp32)


def make_model(gating: str, qk_norm: bool, rotary_fraction: float = 1.0, num_experts: int = EXPERTS,
               shared: int = 16) -> Transformer:
    router = RouterConfig(gating=gating, top_k=2, expert_bias=gating == "sigmoid")
    cfg = validate(Config(model=ModelConfig(
        vocab_size=VOCAB, d_model=D, num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM,
        dense_hidden=48, num_experts=num_experts, expert_hidden=16, shared_expert_hidden=shared if num_experts else 0,
        dense_layers=[0] if num_experts else [], qk_norm=qk_norm, attention_bias=True,
        rotary_fraction=rotary_fraction, init_std=0.1, rope_theta=500.0, router=router))).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert all(not p.any() for n, p in model.named_parameters() if n.endswith(".bias"))  # initialised to zero
    randomise(model)
    for _, r in model.routers():
        r.expert_bias.copy_(0.1 * torch.randn_like(r.expert_bias))
    return model.eval()


EXPORTS = {  # our model -> (the class it exports as, what its config.json says about biases and rotary)
    "glm4_moe": (dict(gating="sigmoid", qk_norm=False, rotary_fraction=0.5),
                 dict(attention_bias=True, partial_rotary_factor=0.5)),
    "glm4_moe_qk_norm": (dict(gating="sigmoid", qk_norm=True, rotary_fraction=0.25),
                         dict(attention_bias=True, partial_rotary_factor=0.25)),
    "qwen2_moe": (dict(gating="softmax", qk_norm=False), dict(qkv_bias=True)),
    "qwen3_moe": (dict(gating="softmax", qk_norm=True, shared=0), dict(attention_bias=True)),
    "llama": (dict(gating="softmax", qk_norm=False, num_experts=0), dict(attention_bias=True)),
    "qwen3": (dict(gating="softmax", qk_norm=True, num_experts=0), dict(attention_bias=True)),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_a_model_with_attention_biases_exports_to_a_folder_transformers_computes_exactly(name, tmp_path):
    """GLM-4-MoE and Qwen2-MoE bias q/k/v as we do; Llama's, Qwen3's and Qwen3-MoE's attention_bias also biases
    o_proj, which is written as zeros. Import gives every tensor and both fields back."""
    kwargs, keys = EXPORTS[name]
    model = make_model(**kwargs)
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: hf_cfg[k] for k in keys} == keys
    if "partial_rotary_factor" in keys:
        assert hf_cfg["rope_parameters"]["partial_rotary_factor"] == keys["partial_rotary_factor"]
    tensors = folder_tensors(tmp_path / "hf")
    o_bias = "model.layers.0.self_attn.o_proj.bias"
    assert (o_bias in tensors) == (name in ("qwen3_moe", "llama", "qwen3"))
    assert not tensors.get(o_bias, torch.zeros(1)).any()
    ids = token_ids()
    with torch.no_grad():
        ours = model(ids)[0]
    diff = (hf_logits(tmp_path / "hf", ids) - ours).abs().max().item()
    assert diff < 1e-4, diff
    cfg, state = import_hf(tmp_path / "hf")
    assert cfg.model.attention_bias and cfg.model.rotary_fraction == model.cfg.rotary_fraction
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_non_zero_output_projection_bias_is_refused_naming_the_tensor(tmp_path):
    """Llama's attention_bias biases o_proj too; moe-train has no such bias, so only zeros import."""
    export_hf_folder(dataclasses.asdict(make_model("softmax", False, num_experts=0).cfg),
                     make_model("softmax", False, num_experts=0).state_dict(), tmp_path / "hf", dtype="fp32")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.self_attn.o_proj.bias"][3] = 0.25
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match=r"tensor model\.layers\.1\.self_attn\.o_proj\.bias is not all zeros "
                                                r"\(max \|x\| = 0\.25\): moe-train's attention_bias puts biases on "
                                                r"q, k and v only"):
        import_hf(tmp_path / "hf", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(gating="softmax", qk_norm=False, rotary_fraction=0.5),
     r"rotary_fraction=0\.5 with softmax gating \(Qwen2-MoE and Qwen3-MoE rotate the whole head\).*nearest that "
     r"exports: router\.gating='sigmoid' \(Glm4MoeForCausalLM\) or rotary_fraction=1\.0"),
    (dict(gating="softmax", qk_norm=True, rotary_fraction=0.5, num_experts=0),
     r"rotary_fraction=0\.5 in a dense model \(LlamaForCausalLM and Qwen3ForCausalLM rotate the whole head\)"),
])
def test_partial_rotary_without_a_class_that_computes_it_is_refused_by_the_export(kwargs, message, tmp_path):
    model = make_model(**kwargs)
    with pytest.raises(HFConversionError, match=message):
        export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf").exists()


HF_CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts_per_tok=2)


@pytest.mark.parametrize(("config", "message"), [
    ({"model_type": "glm4_moe", "n_routed_experts": 4, "partial_rotary_factor": 0.3},
     r"config\.json partial_rotary_factor=0\.3: expected a fraction in \(0, 1\] of head_dim=8 that rotates a whole "
     r"even number of dims"),
    ({"model_type": "glm4_moe", "n_routed_experts": 4, "head_dim": 6, "partial_rotary_factor": 0.25},
     r"partial_rotary_factor=0\.25: expected a fraction in \(0, 1\] of head_dim=6"),
    ({"model_type": "glm4_moe", "n_routed_experts": 4, "attention_bias": "yes"},
     r"config\.json attention_bias='yes': expected true or false"),
    ({"model_type": "qwen2_moe", "num_experts": 4, "partial_rotary_factor": 0.5},
     r"partial_rotary_factor=0\.5: expected 1\.0 \(Qwen2MoeForCausalLM rotates the whole head; only "
     r"Glm4MoeForCausalLM rotates part of it\)"),
    ({"model_type": "llama", "attention_bias": True, "mlp_bias": True}, r"config\.json mlp_bias=True: expected false"),
    ({"model_type": "llama", "use_sliding_window": True},  # Qwen2-MoE's windows import (sliding_window_pattern)
     r"config\.json use_sliding_window=True: expected false"),
])
def test_hf_configs_that_remain_impossible_are_refused_naming_the_key(config, message):
    with pytest.raises(HFConversionError, match=message):
        from_hf_config({**HF_CONFIG, **config})


def test_a_folder_exported_before_the_fields_existed_imports_without_biases_and_whole_head_rotary(tmp_path):
    """Our earlier exports say attention_bias=false / qkv_bias=false and partial_rotary_factor=1.0: they import as
    before, and so does a checkpoint's model section written without the two keys."""
    for name in ("glm4_moe", "qwen2_moe"):
        kwargs = dict(EXPORTS[name][0], rotary_fraction=1.0)
        model = make_model(**kwargs)
        cfg = dataclasses.asdict(model.cfg)
        del cfg["attention_bias"], cfg["rotary_fraction"]
        state = {k: v for k, v in model.state_dict().items() if not k.endswith("_proj.bias")}
        export_hf_folder(cfg, state, tmp_path / name, dtype="fp32")
        hf_cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert hf_cfg.get("attention_bias", False) is False and hf_cfg.get("qkv_bias", False) is False
        imported = open_hf_folder(tmp_path / name).model_config
        assert imported["attention_bias"] is False and imported["rotary_fraction"] == 1.0
