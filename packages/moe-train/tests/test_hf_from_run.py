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
