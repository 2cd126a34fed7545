"""HF -> ours -> HF is bit-identical; broken folders are refused naming the tensor; push and tokenizer wiring."""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_ckpt.hf import HFConversionError, export_hf_folder, open_hf_folder
from moe_train import hf_bridge
from moe_train.config import Config, ModelConfig, RouterConfig, validate
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden=48, num_experts=4,
            expert_hidden=16, init_std=0.08)
VARIANTS = {
    "qwen3_moe": dict(qk_norm=True, dense_layers=[2], router=dict(top_k=2)),
    "qwen2_moe": dict(qk_norm=False, shared_expert_hidden=24, dense_layers=[0], router=dict(top_k=2)),
    "glm4_moe": dict(qk_norm=True, shared_expert_hidden=16, dense_layers=[0],
                     router=dict(gating="sigmoid", top_k=2, expert_bias=True)),
    # a sigmoid router trained without the selection bias: it came back as expert_bias=True (a live zero bias)
    "glm4_moe_no_bias": dict(qk_norm=True, shared_expert_hidden=16, dense_layers=[0],
                             router=dict(gating="sigmoid", top_k=2, expert_bias=False)),
    "llama": dict(num_experts=0, tie_embeddings=True),
}


def make_model(**overrides) -> Transformer:
    kw = {**BASE, **overrides}
    cfg = validate(Config(model=ModelConfig(router=RouterConfig(**kw.pop("router", {})), **kw))).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        for _, r in model.routers():
            r.expert_bias.copy_(0.1 * torch.randn_like(r.expert_bias))
    return model


def folder_contents(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        tensors.update(load_file(str(f)))
    return json.loads((folder / "config.json").read_text()), tensors


def assert_identical(a, b) -> None:
    cfg_a, ta = folder_contents(a)
    cfg_b, tb = folder_contents(b)
    assert cfg_a == cfg_b
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
    assert (a / "generation_config.json").read_text() == (b / "generation_config.json").read_text()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_to_ours_to_hf_is_bit_identical(variant, dtype, tmp_path):
    model = make_model(**VARIANTS[variant])
    first, ckpt, second = tmp_path / "a", tmp_path / "ckpt", tmp_path / "b"
    export_hf(model, first, dtype=dtype, extra_config={"eos_token_id": 3, "max_position_embeddings": 256})
    cfg, state = import_hf(first, ckpt)
    assert cfg.model.num_experts == model.cfg.num_experts and cfg.model.router.gating == model.cfg.router.gating
    assert cfg.model.router.expert_bias == model.cfg.router.expert_bias
    if dtype == "fp32":  # our tensors come back exactly, and load strictly into a fresh model
        for name, t in model.state_dict().items():
            assert torch.equal(state[name], t), name
        Transformer(cfg.model).load_state_dict(state, strict=True)
    export_hf(ckpt, second, dtype=dtype)
    assert_identical(first, second)


def test_transformers_saved_folder_round_trips(tmp_path):
    """A folder written by transformers itself (Qwen3-MoE, random init) comes back bit for bit."""
    hf_cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(hf_cfg).save_pretrained(tmp_path / "native")
    cfg, state = import_hf(tmp_path / "native", tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "again", dtype="fp32")
    native_cfg, native = folder_contents(tmp_path / "native")
    ours_cfg, again = folder_contents(tmp_path / "again")
    assert sorted(native) == sorted(again)
    assert all(torch.equal(native[k], again[k]) for k in native)
    for key, value in ours_cfg.items():
        if key not in ("dtype", "initializer_range", "router_aux_loss_coef", "use_cache", "sliding_window"):
            assert native_cfg.get(key, value) == value, key


def test_a_learned_gate_in_a_folder_that_says_ungated_is_refused(tmp_path):
    """A learned shared_expert_gate imports as model.shared_expert_gate (test_hf_qwen2_moe_gate.py; moe-ckpt <= 0.8
    refused every one); a folder whose config.json says, as our export of an ungated model does, that the shared
    expert has no gate must hold a zero (pinned open) one."""
    hf_cfg = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, qkv_bias=False)
    transformers.Qwen2MoeForCausalLM(hf_cfg).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "moe_train_shared_expert_gate": False}))
    with pytest.raises(HFConversionError, match=r"model\.layers\.0\.mlp\.shared_expert_gate\.weight is not all zeros "
                                                r".*moe_train_shared_expert_gate=false"):
        import_hf(tmp_path)


def test_unrepresentable_hf_config_is_refused(tmp_path):
    export_hf(make_model(**VARIANTS["qwen2_moe"]), tmp_path, dtype="fp32")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 0}))
    with pytest.raises(HFConversionError, match="sliding_window=0: expected an integer >= 1"):
        open_hf_folder(tmp_path)
    # q/k/v biases import (attention_bias), but only with their tensors
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "qkv_bias": True}))
    with pytest.raises(HFConversionError, match=r"tensor model\.layers\.0\.self_attn\.q_proj\.bias \(shape \[32\]\) is "
                                                r"missing"):
        open_hf_folder(tmp_path)


def test_missing_mismatched_and_unexpected_tensors_are_named(tmp_path):
    export_hf(make_model(**VARIANTS["glm4_moe"]), tmp_path, dtype="fp32")
    path = tmp_path / "model.safetensors"
    good = load_file(str(path))
    missing = {k: v for k, v in good.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    save_file(missing, str(path), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match=r"tensor model.layers.1.mlp.experts.3.up_proj.weight \(shape \[16, 32\]\) is missing"):
        open_hf_folder(tmp_path)
    save_file({**good, "model.layers.2.self_attn.k_proj.weight": torch.zeros(8, 32)}, str(path), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match=r"k_proj.weight has shape \[8, 32\], expected \[16, 32\]"):
        open_hf_folder(tmp_path)
    save_file({**good, "model.layers.0.mlp.bias": torch.zeros(2)}, str(path), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="tensor model.layers.0.mlp.bias .* no counterpart"):
        open_hf_folder(tmp_path)


def test_push_to_hub_creates_and_uploads_the_folder(tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def create_repo(self, **kw):
            calls.append(("create_repo", kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))

    monkeypatch.setattr(hf_bridge, "HfApi", FakeApi)
    export_hf(make_model(**VARIANTS["llama"]), tmp_path, push_to_hub="me/tiny-moe")
    assert calls[0] == ("create_repo", {"repo_id": "me/tiny-moe", "repo_type": "model", "private": True,
                                        "exist_ok": True})
    assert calls[1][0] == "upload_folder"
    assert calls[1][1]["repo_id"] == "me/tiny-moe" and calls[1][1]["folder_path"] == str(tmp_path)


def test_tokenizer_files_load_with_auto_tokenizer(tmp_path):
    """prepare-data's own tokenizer (byte-level BPE behind a cut of long non-space runs) loads in
    transformers and encodes as it does."""
    from moe_train.data import train_bpe

    tok = train_bpe(["hello world, mixture of experts"] * 20, 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    model = make_model(vocab_size=tok.get_vocab_size() + 4, num_experts=0)
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf",
                     tokenizer_json=tmp_path / "tokenizer.json", extra_config={"eos_token_id": 0})
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in ("hello world", "x" * 700 + " hello"):
        assert auto(text)["input_ids"] == tok.encode(text).ids
    assert auto.eos_token == "<|endoftext|>"


MAX_SHARD = 100_000  # two shards and an index for the qwen3_moe variant


def _drop_config_key(folder, key: str) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "config.json").write_text("{"), r"config.json is not valid JSON \(JSONDecodeError"),
    (lambda d: (d / "config.json").write_text("[]"), r"config.json holds a JSON list, expected an object"),
    (lambda d: _drop_config_key(d, "hidden_size"),
     r"config.json has no 'hidden_size'; expected a transformers config.json"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{"), r"model.safetensors.index.json is not valid JSON"),
    (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../outside.safetensors"}})),
     r"names shard files \['../outside.safetensors'\] outside the folder"),
    (lambda d: (d / "model-00001-of-00002.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{}"),
     r"model-00001-of-00002.safetensors is not a readable safetensors file \(SafetensorError"),
])
def test_a_damaged_hf_folder_is_refused_naming_the_file(damage, message, tmp_path):
    """Before: json's JSONDecodeError, AttributeError / KeyError from the config, safetensors' own error, and a
    weight_map entry '../x' was opened outside the folder."""
    export_hf(make_model(**VARIANTS["qwen3_moe"]), tmp_path / "hf", dtype="fp32", max_shard_bytes=MAX_SHARD)
    assert (tmp_path / "hf" / "model-00001-of-00002.safetensors").is_file()
    damage(tmp_path / "hf")
    with pytest.raises(HFConversionError, match=message):
        import_hf(tmp_path / "hf")


def test_an_import_output_with_a_damaged_model_file_is_an_hf_error_on_export(tmp_path):
    import_hf(export_hf(make_model(**VARIANTS["llama"]), tmp_path / "hf", dtype="fp32").folder, tmp_path / "ours")
    written = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert written == ["config.json", "hf_extra.json", "model.safetensors"]  # no temporary names left
    (tmp_path / "ours" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(HFConversionError, match=r"ours/model.safetensors is not a readable safetensors file"):
        export_hf(tmp_path / "ours", tmp_path / "again", dtype="fp32")


def test_import_never_writes_into_the_hf_folder_it_reads_nor_over_foreign_files(tmp_path):
    hf = export_hf(make_model(**VARIANTS["llama"]), tmp_path / "hf", dtype="fp32").folder
    before = {p.name: p.read_bytes() for p in hf.iterdir() if p.is_file()}
    with pytest.raises(HFConversionError, match="is the Hugging Face folder being imported"):
        import_hf(hf, hf)
    assert {p.name: p.read_bytes() for p in hf.iterdir() if p.is_file()} == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "notes.txt").write_text("mine")
    with pytest.raises(HFConversionError, match=r"holds \['notes.txt'\]"):
        import_hf(hf, other)
    assert (other / "config.json").read_text() == "{}"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(HFConversionError, match="is a file"):
        import_hf(hf, tmp_path / "afile")
    import_hf(hf, tmp_path / "ours")
    import_hf(hf, tmp_path / "ours")  # over an earlier import: allowed
    # a folder without tokenizer.json gives an import without one
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(set(hf_bridge.IMPORT_FILES) - {"tokenizer.json"})


def test_the_no_expert_bias_marker_must_be_a_boolean(tmp_path):
    export_hf(make_model(**VARIANTS["glm4_moe_no_bias"]), tmp_path, dtype="fp32")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["moe_train_expert_bias"] is False
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "moe_train_expert_bias": "no"}))
    with pytest.raises(HFConversionError, match="moe_train_expert_bias='no': expected true or false"):
        open_hf_folder(tmp_path)


@pytest.mark.parametrize("key,named", [
    ("head_dim", "config.json has no head_dim, taken as hidden_size // num_attention_heads = 8"),
    ("num_key_value_heads", "config.json has no num_key_value_heads, taken as num_attention_heads = 4"),
])
def test_a_config_without_head_keys_names_them_when_the_attention_shapes_disagree(key, named, tmp_path):
    """head_dim 16 (not d / heads = 8) and 2 KV heads: a config.json without those keys failed on a tensor shape
    without saying which key was missing (transformers' class defaults differ: Qwen3's head_dim is 128)."""
    export_hf(make_model(**{**VARIANTS["qwen3_moe"], "head_dim": 16}), tmp_path, dtype="fp32")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConversionError, match=r"model\.layers\.0\.self_attn\..* has shape .*" + named):
        open_hf_folder(tmp_path)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_folder_holding_nan_or_inf_is_refused_by_import_naming_the_tensor_and_writes_nothing(tmp_path, value):
    """Review helper 171: import-hf took such a folder and wrote it out; only a later train.init_from refused it."""
    from safetensors.torch import save_file

    export_hf(make_model(**VARIANTS["qwen3_moe"]), tmp_path / "hf", dtype="fp32")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.q_proj.weight"][1, 2] = value
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match=r"tensor blocks.0.attn.q_proj.weight \(by moe-train's name\) holds 1 "
                                                r"NaN / Inf values of \d+: expected finite weights"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
