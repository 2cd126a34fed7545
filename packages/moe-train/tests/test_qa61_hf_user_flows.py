"""QA 61: Hugging Face export as a user does it: `moe-train export-hf RUN OUT` of a run trained on a prepared
data folder (its tokenizer shipped, AutoTokenizer round-tripping text), over an existing folder, in bf16
(transformers computes exactly our model with bf16-rounded weights), sharded, and the dtype it refuses."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_ckpt.hf import HFConversionError
from moe_train.cli import main
from moe_train.config import Config, ModelConfig, RouterConfig, validate
from moe_train.data.prepare import load_tokenizer
from moe_train.hf_bridge import export_hf, import_hf, open_checkpoint_source
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import folder_tensors, one_thread  # noqa: E402,F401 - autouse: one torch thread for the module

TEXT = "def main(argv):\n    return sorted(set(argv))  # mixture of experts"


def _our_model(run: Path) -> Transformer:
    """The run's latest checkpoint as our model (fp32 masters), read without the HF code."""
    with open_checkpoint_source(run) as (cfg, source):
        model = Transformer(cfg.model)
        model.load_state_dict({name: source(name) for name in model.state_dict()}, strict=True)
    return model.eval()


def _greedy(model: Transformer, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def run(tmp_path, data_dir, make_config):
    """A 1-step run on a prepared data folder, of a model stock transformers computes (Qwen3-MoE)."""
    from moe_train.trainer.loop import Trainer

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    cfg.model.shared_expert_hidden, cfg.model.router.expert_bias = 0, False
    Trainer(cfg).train()
    return tmp_path / "run"


def test_cli_export_of_a_prepared_data_run_ships_its_tokenizer_and_replaces_an_earlier_export(
        run, data_dir, tmp_path, capsys):
    out = tmp_path / "exports" / "hf"
    assert main(["export-hf", str(run), str(out)]) == 0  # bf16, the default
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert main(["export-hf", str(run), str(out), "--dtype", "fp32"]) == 0  # over the earlier export
    assert _listing(out.parent) == ["hf"]  # nothing left beside it
    assert _listing(out) == [".moe_ckpt_export", "config.json", "generation_config.json", "model.safetensors",
                             "tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == (data_dir / "tokenizer.json").read_bytes()

    ours_tok = load_tokenizer(str(data_dir / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = auto(TEXT)["input_ids"]
    assert ids == ours_tok.encode(TEXT).ids and auto.decode(ids) == TEXT
    meta = json.loads((data_dir / "meta.json").read_text())
    assert auto.eos_token_id == meta["eos_id"] and auto.model_max_length == 32  # the run's data.seq_len

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert hf.dtype == torch.float32
    model = _our_model(run)
    prompt = torch.tensor([ids[:8]])
    with torch.no_grad():
        assert (hf(prompt).logits - model(prompt)[0]).abs().max().item() < 2e-5
        generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                eos_token_id=None)
    assert torch.equal(generated, _greedy(model, prompt, 6))


def test_a_sharded_export_of_a_run_loads_in_transformers_and_imports_back_exactly(run, tmp_path):
    out = tmp_path / "hf"
    summary = export_hf(run, out, dtype="fp32", max_shard_bytes=8 * 1024)
    assert summary.shards > 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards and len(shards) == summary.shards
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in folder_tensors(out).values())

    model = _our_model(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)[0]).abs().max().item() < 2e-5
    _, state = import_hf(out)
    for name, t in model.state_dict().items():
        assert torch.equal(state[name], t), name

    export_hf(run, out, dtype="fp32")  # one file now: the earlier shards and index go with the earlier export
    assert _listing(out) == [".moe_ckpt_export", "config.json", "generation_config.json", "model.safetensors",
                             "tokenizer.json", "tokenizer_config.json"]


BASE = dict(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=48, num_experts=4,
            expert_hidden=16, init_std=0.1)
CLASSES = {
    "llama": dict(num_experts=0, attention_bias=True),
    "qwen3": dict(num_experts=0, qk_norm=True),
    "qwen3_moe": dict(qk_norm=True, dense_layers=[0], attention_bias=True),
    "qwen2_moe": dict(shared_expert_hidden=24, attention_bias=True),
    "qwen2_moe_gated": dict(shared_expert_hidden=24, shared_expert_gate=True),
    "glm4_moe": dict(qk_norm=True, rotary_fraction=0.5, shared_expert_hidden=16, dense_layers=[0],
                     router=dict(gating="sigmoid", top_k=2, expert_bias=True, routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("case", list(CLASSES))
def test_a_bf16_export_is_exactly_our_model_with_bf16_rounded_weights(case, tmp_path):
    """bf16 changes the weights and nothing else: transformers, reading the bf16 folder in fp32, computes our
    model with every weight rounded to bf16 (GLM's selection bias, kept fp32, unrounded), and import gives those
    rounded weights back bit for bit."""
    kw = {**BASE, **CLASSES[case]}
    cfg = validate(Config(model=ModelConfig(router=RouterConfig(**kw.pop("router", {})), **kw))).model
    torch.manual_seed(3)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(("norm.weight", ".bias", "expert_bias")) or "shared_expert_gate" in name:
                t.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(t))
    export_hf(model, tmp_path, dtype="bf16")
    rounded = {k: v if k.endswith("expert_bias") else v.to(torch.bfloat16).float()
               for k, v in model.state_dict().items()}
    model.load_state_dict(rounded)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)[0]).abs().max().item() < 2e-5
    _, state = import_hf(tmp_path)
    for name, t in rounded.items():
        assert torch.equal(state[name], t), name


def test_an_unknown_dtype_is_refused_by_name_and_nothing_is_written(run, tmp_path, capsys):
    """bf16, fp16 and fp32 are the export dtypes (fp16 since moe-ckpt 0.13.0: tests/test_hf_fp16_and_shard_size.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(HFConversionError, match=r"dtype='fp8': expected one of bf16, fp16, fp32"):
            export_hf(run, tmp_path / "hf16", dtype="fp8")
    with pytest.raises(SystemExit) as e:
        main(["export-hf", str(run), str(tmp_path / "hf16"), "--dtype", "fp8"])
    assert e.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
    assert _listing(tmp_path) == ["data", "run"]


def test_export_into_a_folder_of_other_files_is_refused_and_the_folder_untouched(run, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "config.json").write_text("{}")
    assert main(["export-hf", str(run), str(out)]) == 2
    assert "holds files that are not a Hugging Face export of ours (notes.txt)" in capsys.readouterr().err
    assert _listing(out) == ["config.json", "notes.txt"] and (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "mine", "run"]
    (tmp_path / "empty").mkdir()
    assert main(["export-hf", str(run), str(tmp_path / "empty")]) == 0  # an empty folder is written into
    assert (tmp_path / "empty" / "model.safetensors").is_file()
