"""An export / import folder's files all get the mode a new file gets (umask), model.safetensors included:
safetensors >= 0.8.1 creates its files 0o600, so other users could not load our exports."""

from __future__ import annotations

import os
import stat

import torch

from moe_ckpt.hf import export_hf_folder
from moe_train.config import Config, ModelConfig, RouterConfig
from moe_train.hf_bridge import import_hf
from moe_train.model import Transformer


def _modes(folder):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}


def test_exported_and_imported_files_share_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        cfg = ModelConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, dense_hidden=16,
                          num_experts=2, expert_hidden=8, router=RouterConfig(top_k=2))
        torch.manual_seed(0)
        model = Transformer(cfg)
        out = tmp_path / "hf"
        export_hf_folder(Config(model=cfg).to_dict()["model"], model.state_dict(), out, dtype="fp32")
        exported = _modes(out)
        assert exported["model.safetensors"] == 0o644 and set(exported.values()) == {0o644}, exported
        imported_dir = tmp_path / "imported"
        import_hf(out, imported_dir)
        imported = _modes(imported_dir)
        assert imported["model.safetensors"] == 0o644 and set(imported.values()) == {0o644}, imported
    finally:
        os.umask(old)
