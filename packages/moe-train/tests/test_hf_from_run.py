"""A trained run folder exports through the CLI and stock transformers reproduces the run's model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_train.cli import main
from moe_train.trainer.loop import Trainer

transformers = pytest.importorskip("transformers")


def test_export_hf_of_a_trained_run_matches_its_model(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)
    cfg.data.path = str(data_dir)
    cfg.model.shared_expert_hidden = 0  # softmax + per-head QK-norm, no shared expert: Qwen3-MoE
    cfg.model.router.expert_bias = False
    trainer = Trainer(cfg)
    trainer.train()
    out = tmp_path / "hf"
    assert main(["export-hf", str(tmp_path / "run"), str(out), "--dtype", "fp32"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 24))
    trainer.model.eval()
    with torch.no_grad():
        ours, _ = trainer.model(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert (out / "tokenizer.json").is_file()  # the data folder's tokenizer travels with the export


def test_export_without_a_findable_tokenizer_warns(tmp_path, data_dir, make_config):
    """The tokenizer is found through the run's data.path; when that folder is not there (moved,
    or a relative path taken from another directory) the export says it has no tokenizer."""
    import json

    from moe_ckpt import find_latest
    from moe_train.hf_bridge import export_hf

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    cfg.model.shared_expert_hidden = 0
    cfg.model.router.expert_bias = False
    Trainer(cfg).train()
    meta_file = find_latest(tmp_path / "run" / "checkpoints") / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["data"]["path"] = str(tmp_path / "moved-away")
    meta_file.write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="no tokenizer found for data.path=.*moved-away"):
        export_hf(tmp_path / "run", tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
