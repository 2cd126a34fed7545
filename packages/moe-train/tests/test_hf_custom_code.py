"""Custom-code Hugging Face export (custom_code=True, export-hf --custom-code): models no stock transformers class
computes (OLMo-core 3's softmax + shared expert + QK-norm, and others the stock export refuses) load with
trust_remote_code=True and compute our function: logits, cached greedy generation, left-padded batches; import
gives back every tensor bit for bit and the same model config.

Tiny fp32 models whose norms, biases, gates and expert biases are all random, so a modeling file that drops or
misplaces one of them shows in the logits. transformers' module cache is kept in a temporary folder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors import safe_open

from moe_ckpt.hf import HFConversionError
from moe_train.cli import main
from moe_train.config import Config
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_home, one_thread, our_greedy, random_model  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.usefixtures("hf_home")  # transformers' caches in a temporary folder

BASE = dict(vocab_size=97, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden=40, num_experts=4,
            expert_hidden=16, init_std=0.1, rope_theta=1000.0, norm_eps=1e-5)

# name -> (ModelConfig overrides, what the stock export's refusal names); none of them has a stock class
REFUSED_BY_STOCK = {
    # OLMo-core 3's shape (presets olmo3-bench-e*): softmax + shared expert + per-head QK-norm, a leading dense layer
    "olmo3": (dict(qk_norm=True, shared_expert_hidden=24, dense_layers=[0], router=dict(top_k=2)),
              "softmax gating + shared expert + per-head qk_norm"),
    # sigmoid + gated shared expert, tied embeddings, a dense layer that is not leading, MHA
    "sigmoid_gated_shared": (dict(num_kv_heads=4, shared_expert_hidden=20, shared_expert_gate=True,
                                  tie_embeddings=True, dense_layers=[1],
                                  router=dict(gating="sigmoid", expert_bias=True, routed_scaling_factor=2.5)),
                             "dense_layers=[1] with sigmoid gating"),
    # softmax + selection bias + routed scaling + half-rotary heads + q/k/v biases, MQA
    "softmax_bias_scaled_half_rotary": (dict(num_kv_heads=1, rotary_fraction=0.5, attention_bias=True,
                                             router=dict(top_k=3, expert_bias=True, routed_scaling_factor=1.7)),
                                        "routed_scaling_factor=1.7 with softmax gating"),
}


def make_model(overrides: dict) -> Transformer:
    return random_model(BASE, overrides, seed=3)


@pytest.mark.parametrize("case", list(REFUSED_BY_STOCK))
def test_a_model_no_stock_class_computes_exports_as_custom_code_computing_our_function(case, tmp_path):
    overrides, refused_for = REFUSED_BY_STOCK[case]
    model = make_model(overrides)
    with pytest.raises(HFConversionError, match="no stock transformers class") as refusal:
        export_hf(model, tmp_path / "stock", dtype="fp32")
    message = str(refusal.value)
    assert refused_for in message and "custom_code=True" in message and "--custom-code" in message
    assert "trust_remote_code=True" in message and not (tmp_path / "stock").exists()

    out = tmp_path / case
    summary = export_hf(model, out, dtype="fp32", custom_code=True)
    assert summary.architecture == "MoeTrainForCausalLM"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "moe_train" and config["auto_map"]["AutoModelForCausalLM"]
    assert config["hidden_size"] == model.cfg.d_model and config["tie_word_embeddings"] == model.cfg.tie_embeddings
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                          trust_remote_code=True).eval()
    assert type(hf).__name__ == "MoeTrainForCausalLM"

    ids = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids)[0], hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4, (ours - theirs).abs().max().item()

    prompt = ids[:1, :5]
    with torch.no_grad():
        generated = hf.generate(prompt, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(generated, our_greedy(model, prompt, 16))

    # left padding: row 1 is ids[1, :8] behind 4 pads; its real tokens compute what they compute alone
    short = ids[1:, :8]
    batch = torch.cat([ids[:1], torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    with torch.no_grad():
        padded = hf(batch, attention_mask=mask).logits
        alone = model(short)[0][0]
        generated = hf.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert (padded[1, 4:] - alone).abs().max().item() < 1e-4
    assert (padded[0] - ours[0]).abs().max().item() < 1e-4
    assert torch.equal(generated[1, 4:], our_greedy(model, short, 6)[0])
    assert torch.equal(generated[0], our_greedy(model, ids[:1], 6)[0])

    cfg, state = import_hf(out)
    assert cfg.model == model.cfg
    ref = model.state_dict()
    assert set(state) == set(ref)
    for name, t in ref.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], t), name


def test_cli_custom_code_export_of_a_checkpoint_keeps_the_expert_bias_fp32_and_imports_back(tmp_path, capsys):
    """export-hf --custom-code from a model.safetensors + config.json checkpoint, in bf16, then import-hf: the same
    model config, the weights bf16-rounded, the selection bias (fp32 in the folder) exact."""
    from safetensors.torch import load_file, save_file

    overrides = REFUSED_BY_STOCK["olmo3"][0]
    model = make_model({**overrides, "router": {**overrides["router"], "expert_bias": True}})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(Config(model=model.cfg).to_dict()))
    out = tmp_path / "hf"
    assert main(["export-hf", str(ckpt), str(out), "--custom-code"]) == 0
    printed = capsys.readouterr()
    assert "MoeTrainForCausalLM" in printed.out and "trust_remote_code=True" in printed.out
    assert "no tokenizer found" in printed.err  # a checkpoint of the embedded corpus: nothing to ship
    assert {"configuration_moe_train.py", "modeling_moe_train.py"} <= {p.name for p in out.iterdir()}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if k.endswith("expert_bias")} == {"F32"}
    assert {d for k, d in dtypes.items() if not k.endswith("expert_bias")} == {"BF16"}

    assert main(["import-hf", str(out), str(tmp_path / "imported")]) == 0
    imported = json.loads((tmp_path / "imported" / "config.json").read_text())["model"]
    assert imported == Config(model=model.cfg).to_dict()["model"]
    state = load_file(str(tmp_path / "imported" / "model.safetensors"))
    for name, t in model.state_dict().items():
        rounded = t if name.endswith("expert_bias") else t.to(torch.bfloat16).float()
        assert torch.equal(state[name], rounded), name
