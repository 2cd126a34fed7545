"""import-hf keeps the Hugging Face folder's tokenizer, so exporting the import again carries it."""

from __future__ import annotations

import dataclasses
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_ckpt.hf import export_hf_folder
from moe_train.config import Config, ModelConfig, validate
from moe_train.data import train_bpe
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer
from metadata_edit import rewrite_metadata  # noqa: E402

transformers = pytest.importorskip("transformers")


def _hf_folder(path, with_tokenizer: bool):
    tok = train_bpe(["hello world, mixture of experts"] * 20, 300)
    cfg = validate(Config(model=ModelConfig(vocab_size=tok.get_vocab_size() + 4, d_model=32, num_layers=2,
                                            num_heads=4, num_kv_heads=2, dense_hidden=48, num_experts=0))).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    kwargs = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tok.save(str(path.parent / "tokenizer.json"))
        kwargs["tokenizer_json"] = path.parent / "tokenizer.json"
    export_hf_folder(dataclasses.asdict(cfg), model.state_dict(), path, extra_config={"eos_token_id": 0}, **kwargs)
    return tok


def test_an_imported_folder_exports_again_with_its_tokenizer(tmp_path):
    tok = _hf_folder(tmp_path / "hf", with_tokenizer=True)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no tokenizer found"
        export_hf(tmp_path / "ckpt", tmp_path / "again", dtype="fp32")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "again"))
    assert auto("hello world")["input_ids"] == tok.encode("hello world").ids


def test_reimporting_a_folder_without_a_tokenizer_drops_the_earlier_one(tmp_path):
    _hf_folder(tmp_path / "with" / "hf", with_tokenizer=True)
    _hf_folder(tmp_path / "without" / "hf", with_tokenizer=False)
    import_hf(tmp_path / "with" / "hf", tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
    import_hf(tmp_path / "without" / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "tokenizer.json").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "hf_extra.json", "model.safetensors"]


def test_export_hf_cli_ships_the_tokenizer_it_is_given(tmp_path, data_dir, make_config, capsys):
    """A run whose data folder moved: `export-hf --tokenizer FILE` ships FILE, with no warning."""
    import json

    from moe_ckpt import find_latest
    from moe_train.cli import main
    from moe_train.trainer.loop import Trainer

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    cfg.model.shared_expert_hidden, cfg.model.router.expert_bias = 0, False  # a model stock transformers computes
    Trainer(cfg).train()
    meta_file = find_latest(tmp_path / "run" / "checkpoints") / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["data"]["path"] = str(tmp_path / "moved-away")
    rewrite_metadata(meta_file, meta)
    tok = data_dir / "tokenizer.json"
    capsys.readouterr()
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "fp32", "--tokenizer", str(tok)]) == 0
    assert "no tokenizer found" not in capsys.readouterr().err
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf2"), "--tokenizer", str(tmp_path / "none.json")]) == 2
    assert "none.json' is not a file" in capsys.readouterr().err
