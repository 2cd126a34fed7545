"""QA pass 33: an export to an out_dir that is a symbolic link to a folder writes the export into that folder."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from moe_ckpt.hf import export_hf_folder

MODEL = {"vocab_size": 32, "d_model": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": None,
         "qk_norm": False, "rope_theta": 10000.0, "norm_eps": 1e-6, "dense_hidden": 24, "dense_layers": [],
         "num_experts": 0, "expert_hidden": 16, "shared_expert_hidden": 0, "tie_embeddings": False,
         "init_std": 0.02, "router": {"gating": "softmax", "top_k": 1, "normalize_top_k": True, "routing": "learned",
                                      "expert_bias": False}}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(32, 16, generator=g), "norm.weight": torch.ones(16),
           "lm_head.weight": torch.randn(32, 16, generator=g),
           "blocks.0.attn_norm.weight": torch.ones(16), "blocks.0.mlp_norm.weight": torch.ones(16)}
    for p, shape in (("q", (16, 16)), ("k", (8, 16)), ("v", (8, 16)), ("o", (16, 16))):
        out[f"blocks.0.attn.{p}_proj.weight"] = torch.randn(shape, generator=g)
    for p, shape in (("gate", (24, 16)), ("up", (24, 16)), ("down", (16, 24))):
        out[f"blocks.0.mlp.{p}.weight"] = torch.randn(shape, generator=g)
    return out


def test_an_out_dir_that_links_to_a_folder_receives_the_export_and_stays_a_link(tmp_path):
    """Before: the link itself was renamed aside and the export put in its place as a real folder beside it (on
    the link's file system, not the one it points to); the folder it pointed to stayed empty, and the renamed
    link was left behind as a hidden .hf.old-* entry that no later export removes (rmtree refuses a link)."""
    (tmp_path / "scratch" / "hf").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    link = tmp_path / "work" / "hf"
    os.symlink(tmp_path / "scratch" / "hf", link)
    for seed in (0, 1):  # a first export into the empty folder, then one that replaces it
        export_hf_folder(MODEL, state(seed), link, dtype="fp32")
        assert link.is_symlink() and os.readlink(link) == str(tmp_path / "scratch" / "hf")
        assert sorted(os.listdir(tmp_path / "work")) == ["hf"]  # nothing left beside the link
        target = tmp_path / "scratch" / "hf"
        assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
        got = load_file(str(target / "model.safetensors"))
        assert torch.equal(got["lm_head.weight"], state(seed)["lm_head.weight"])
        assert sorted(os.listdir(tmp_path / "scratch")) == ["hf"]  # the temporary folders went too
