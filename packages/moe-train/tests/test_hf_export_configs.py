"""Exported config.json / generation_config.json / tokenizer files say what the model is, to every reader.

The export mapping itself (logits, padding, KV-cache generation, import) is exercised over many shapes in
test_hf_export.py and test_hf_roundtrip.py; these tests pin what the folder's JSON tells a reader: the RoPE
and dtype keys older readers use, the no-expert-bias marker, token ids that are not left to class defaults,
the trained context length, the keys an imported config.json may leave out, which refusal a user sees first,
and model fields the export does not know.
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

from moe_ckpt.hf import HFConversionError, export_hf_folder, from_hf_config
from moe_train.cli import main
from moe_train.config import Config, ModelConfig, RouterConfig, validate
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer
from moe_train.presets import get_preset

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import one_thread  # noqa: E402,F401 - autouse: one torch thread for the module

BASE = dict(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=48, num_experts=4,
            expert_hidden=16, init_std=0.08, rope_theta=500.0)
SHAPES = {  # one per stock class
    "llama": dict(num_experts=0),
    "qwen3": dict(num_experts=0, qk_norm=True),
    "qwen3_moe": dict(qk_norm=True, router=dict(top_k=2)),
    "qwen2_moe": dict(shared_expert_hidden=16, router=dict(top_k=2)),
    "glm4_moe": dict(qk_norm=True, shared_expert_hidden=16,
                     router=dict(gating="sigmoid", top_k=2, expert_bias=True)),
}




def make_model(**overrides) -> Transformer:
    kw = {**BASE, **overrides}
    cfg = validate(Config(model=ModelConfig(router=RouterConfig(**kw.pop("router", {})), **kw))).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for _, router in model.routers():
            router.expert_bias.copy_(0.1 * torch.randn_like(router.expert_bias))
    return model.eval()


def export(model: Transformer, out, **kw):
    return export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), out, dtype="fp32", **kw)


def read_json(path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_reader_of_the_legacy_rope_keys_computes_our_function(shape, tmp_path):
    """transformers 4.x (the workspace allows >=4.56) reads rope_theta and GLM-4-MoE's partial_rotary_factor
    from the top level only. Before, they were written inside rope_parameters alone: transformers 4.57 loaded
    every export without a warning and computed with rope_theta 10000 (GLM: half-head rotary), logits off by
    0.04-1.9. Here the folder is read as 4.x reads it: rope_parameters removed, transformers 5 falls back to
    the legacy keys."""
    model = make_model(**SHAPES[shape])
    export(model, tmp_path)
    cfg = read_json(tmp_path / "config.json")
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 500.0
    del cfg["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens)[0] - hf(tokens).logits).abs().max().item() <= 1e-4



@pytest.mark.parametrize("dtype,stored", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_config_json_names_the_dtype_of_the_stored_weights_for_old_and_new_readers(dtype, stored, tmp_path):
    """Before: only `dtype` was written, which transformers >= 4.56 reads; transformers 4.x before that, and
    tools that read config.json themselves, read `torch_dtype` and found none. Here the folder is also read
    as such a reader sees it (`dtype` removed). GLM's e_score_correction_bias is stored fp32 in every export."""
    model = make_model(**SHAPES["glm4_moe"])
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path, dtype=dtype)
    tensors = {name: t for f in tmp_path.glob("*.safetensors") for name, t in load_file(f).items()}
    assert {t.dtype for name, t in tensors.items() if not name.endswith(".e_score_correction_bias")} == {stored}
    cfg = read_json(tmp_path / "config.json")
    assert cfg["torch_dtype"] == cfg["dtype"] == str(stored).removeprefix("torch.")
    assert transformers.AutoConfig.from_pretrained(str(tmp_path)).torch_dtype == stored
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype="auto")
    assert hf.get_input_embeddings().weight.dtype == stored
    del cfg["dtype"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert transformers.AutoConfig.from_pretrained(str(tmp_path)).torch_dtype == stored


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_selection_bias_is_stored_fp32_bit_for_bit_in_every_export(dtype, tmp_path):
    """GLM's e_score_correction_bias (our router's expert_bias) is stored fp32 whatever the export dtype: the test
    above excludes it, with bias values exact in fp16, so a mutation audit (review helper 161) that exported it in
    the weights' dtype passed every stock-class test. Here: values not exact in bf16 or fp16, stored exactly."""
    model = make_model(**SHAPES["glm4_moe"])
    state = model.state_dict()
    biases = sorted(k for k in state if k.endswith("expert_bias"))
    assert biases, "the glm4_moe shape has no expert bias"
    with torch.no_grad():
        for k in biases:
            state[k].copy_(torch.linspace(-1e-3, 1e-3, state[k].numel()) + 1 / 3)  # 1/3: exact in neither
    export_hf_folder(dataclasses.asdict(model.cfg), state, tmp_path, dtype=dtype)
    tensors = {n: t for f in tmp_path.glob("*.safetensors") for n, t in load_file(f).items()}
    got = {n: t for n, t in tensors.items() if n.endswith(".e_score_correction_bias")}
    assert len(got) == len(biases) and {t.dtype for t in got.values()} == {torch.float32}
    for name, t in got.items():
        layer = name.split("layers.")[1].split(".")[0]
        (ours,) = [k for k in biases if k.split(".")[1] == layer]
        assert torch.equal(t, state[ours].float()), name



def test_the_no_expert_bias_marker_refuses_a_selection_bias_that_is_no_longer_zero(tmp_path):
    """A sigmoid router without expert bias exports a zero e_score_correction_bias and moe_train_expert_bias=false,
    and imports back without the bias. A folder whose bias was changed afterwards would compute differently: it
    is refused naming the tensor; without the marker the same folder imports with the bias live."""
    model = make_model(**{**SHAPES["glm4_moe"], "router": dict(gating="sigmoid", top_k=2, expert_bias=False)})
    export(model, tmp_path / "hf")
    assert read_json(tmp_path / "hf" / "config.json")["moe_train_expert_bias"] is False
    assert import_hf(tmp_path / "hf", tmp_path / "ours")[0].model.router.expert_bias is False
    name, file = "model.layers.1.mlp.gate.e_score_correction_bias", tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    assert tensors[name].dtype == torch.float32 and not tensors[name].any()
    tensors[name][2] = 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match=rf"tensor {name} is not all zeros \(max \|x\| = 0\.5\): config.json's "
                                                r"moe_train_expert_bias=false says .*; remove that key"):
        import_hf(tmp_path / "hf", tmp_path / "refused")
    cfg = read_json(tmp_path / "hf" / "config.json")
    del cfg["moe_train_expert_bias"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    config, state = import_hf(tmp_path / "hf", tmp_path / "live")
    assert config.model.router.expert_bias is True and state["blocks.1.mlp.router.expert_bias"][2] == 0.5


def test_unknown_token_ids_are_written_null_not_left_to_class_defaults(tmp_path):
    """Before: a Llama export without token ids had none in config.json, and LlamaConfig's defaults (bos 1,
    eos 2: ordinary BPE tokens of ours) became the model's; with eos from the data folder, bos was still 1."""
    model = make_model(**SHAPES["llama"])
    export(model, tmp_path / "none")
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "none"))
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, None, None)
    assert read_json(tmp_path / "none" / "generation_config.json") == {"_from_model_config": True}
    export(model, tmp_path / "eos", extra_config={"eos_token_id": 0})
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "eos"))
    assert (config.bos_token_id, config.eos_token_id) == (None, 0)
    assert read_json(tmp_path / "eos" / "generation_config.json") == {"_from_model_config": True, "eos_token_id": 0}


def test_export_of_a_checkpoint_claims_the_context_length_it_trained_at(tmp_path):
    """Before: max_position_embeddings (and the tokenizer's model_max_length) was 4096 for every run: the
    olmo3-bench presets train at 8192 and the tokenizer then warned about inputs the model was trained on;
    the tiny preset trains at 128."""
    from moe_train.data import train_bpe

    tok = train_bpe(["hello world, mixture of experts"] * 20, 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = validate(Config(model=make_model(**SHAPES["qwen3_moe"], vocab_size=tok.get_vocab_size()).cfg))
    cfg.data.seq_len = 8192
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in Transformer(cfg.model).state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(cfg.to_dict()))
    export_hf(ckpt, tmp_path / "hf", dtype="fp32", tokenizer_json=tmp_path / "tokenizer.json")
    assert read_json(tmp_path / "hf" / "config.json")["max_position_embeddings"] == 8192
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf")).model_max_length == 8192
    export_hf(ckpt, tmp_path / "hf2", dtype="fp32", tokenizer_json=tmp_path / "tokenizer.json",
              extra_config={"max_position_embeddings": 512})  # asked for: it wins
    assert read_json(tmp_path / "hf2" / "config.json")["max_position_embeddings"] == 512


HF_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts_per_tok=2)


@pytest.mark.parametrize(("model_type", "extra", "ours"), [
    ("glm4_moe", dict(n_routed_experts=4), dict(rotary_fraction=0.5, attention_bias=False)),
    ("qwen2_moe", dict(num_experts=4), dict(rotary_fraction=1.0, attention_bias=True)),
])
def test_a_config_key_left_out_means_transformers_default_not_ours(model_type, extra, ours):
    """Before (moe-ckpt 0.6): a GLM-4-MoE config.json without partial_rotary_factor was imported as whole-head
    rotary (transformers rotates half: a different model, silently); a Qwen2-MoE one without qkv_bias as bias-free
    (transformers' default has q/k/v biases). 0.7.0 refused both; now both import as transformers reads them."""
    m = from_hf_config({"model_type": model_type, **HF_SIZES, **extra})[0]
    assert {k: m[k] for k in ours} == ours


def test_a_glm_config_without_rms_norm_eps_imports_transformers_default():
    """Before: 1e-6 (ours), where transformers' Glm4MoeConfig computes with 1e-5."""
    glm = {"model_type": "glm4_moe", **HF_SIZES, "n_routed_experts": 4, "partial_rotary_factor": 1.0}
    assert from_hf_config(glm)[0]["norm_eps"] == transformers.AutoConfig.for_model(**glm).rms_norm_eps == 1e-5


@pytest.mark.parametrize(("change", "message"), [
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}),
     r"config.json partial_rotary_factor=0.3: expected a fraction in \(0, 1\] of head_dim=8"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     r"config.json rope_scaling=\{'rope_type': 'yarn', 'factor': 4.0\}: expected 'default'"),
    (dict(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     r"config.json rope_theta=500000.0: expected the same as rope_parameters.rope_theta=10000.0"),
])
def test_rope_refusals_name_the_value_transformers_reads(change, message):
    """Before: 'partial_rotary_factor=None' and 'rope_parameters.rope_type=None' for values that were there
    (inside rope_parameters, or in rope_scaling), and a top-level rope_theta that disagrees with
    rope_parameters' (transformers 4 and 5 would each compute another model) was taken without a word."""
    with pytest.raises(HFConversionError, match=message):
        from_hf_config({"model_type": "glm4_moe", **HF_SIZES, "n_routed_experts": 4, **change})


def test_a_benchmark_preset_is_refused_for_its_architecture_first_and_without_a_tokenizer_warning(tmp_path, capsys):
    """The olmo3-bench presets use random routing and softmax + shared expert + QK-norm. Before: export-hf said
    to pass allow_benchmark_routing=True (and warned that no tokenizer was found); doing so only led to the
    second refusal. Now the refusal that no flag lifts comes first, alone."""
    cfg = get_preset("olmo3-bench-e8")
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 64, 32, 2, 4, 2
    m.dense_hidden, m.expert_hidden, m.shared_expert_hidden, m.num_experts, m.router.top_k = 48, 16, 16, 4, 2
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in Transformer(validate(cfg).model).state_dict().items()},
              str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-train: error: softmax gating + shared expert + per-head qk_norm"), err
    assert "tokenizer" not in err and not (tmp_path / "hf").exists()
    m.shared_expert_hidden = 0  # an architecture that exports: now the routing is what is refused, naming the flag
    (ckpt / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file({k: v.contiguous() for k, v in Transformer(validate(cfg).model).state_dict().items()},
              str(ckpt / "model.safetensors"))
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "router.routing='random' is a benchmark mode" in err and "--allow-benchmark-routing" in err, err
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--allow-benchmark-routing"]) == 0
    assert "no tokenizer found" in capsys.readouterr().err  # the warning still comes when the export goes ahead


def test_a_model_field_the_export_does_not_know_is_refused_by_name(tmp_path):
    """Before: the export mapped the fields it knew and ignored the rest, so a field added to ModelConfig
    (an attention variant, say) would export a folder that computes another function, without a word. Every
    field of today's ModelConfig is known; a new one is refused until moe_ckpt.hf.spec is taught it."""
    model = make_model(**SHAPES["qwen3_moe"])
    m = dataclasses.asdict(model.cfg)
    export_hf_folder(m, model.state_dict(), tmp_path / "known", dtype="fp32")
    for extra, name in (({"sliding_window": 64}, r"model.sliding_window=64"),
                        ({"router": {**m["router"], "score_scale": 2.5}}, r"model.router.score_scale=2.5")):
        with pytest.raises(HFConversionError, match=rf"{name} is a field the Hugging Face export does not know"):
            export_hf_folder({**m, **extra}, model.state_dict(), tmp_path / "new", dtype="fp32")
    assert not (tmp_path / "new").exists()
