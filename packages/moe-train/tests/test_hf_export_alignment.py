"""Export warns when expert rows are not 16-byte multiples: transformers loads such a folder, then its
grouped_mm fails on the first forward."""

from __future__ import annotations

import dataclasses
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_ckpt.hf import export_hf_folder
from moe_train.config import Config, ModelConfig, RouterConfig, validate
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")


def tiny_moe(d_model: int, expert_hidden: int) -> Transformer:
    cfg = validate(Config(model=ModelConfig(
        vocab_size=96, d_model=d_model, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, dense_hidden=32,
        num_experts=4, expert_hidden=expert_hidden, qk_norm=True, router=RouterConfig(top_k=2)))).model
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def test_export_warns_naming_expert_sizes_whose_rows_grouped_mm_refuses(tmp_path):
    model = tiny_moe(d_model=48, expert_hidden=12)  # 12 bf16 elements = 24 bytes
    with pytest.warns(UserWarning, match=r"model.expert_hidden=12 \(24 bytes per bf16 row\)") as caught:
        export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="bf16")
    assert "model.d_model=" not in str(caught[0].message)
    ids = torch.randint(0, 96, (1, 5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        hf(ids)  # what the warning is about
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16,
                                                           experts_implementation="eager")
    with torch.no_grad():
        assert torch.isfinite(hf(ids).logits).all()  # the way out the warning names


def test_fp32_export_warns_about_bf16_rows_too_and_aligned_exports_are_quiet(tmp_path):
    model = tiny_moe(d_model=36, expert_hidden=16)  # 144 bytes per fp32 row (fine), 72 per bf16 row
    with pytest.warns(UserWarning, match=r"model.d_model=36 \(72 bytes per bf16 row\)") as caught:
        export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "a", dtype="fp32")
    assert "fp32 row" not in str(caught[0].message) and "model.expert_hidden=" not in str(caught[0].message)
    model = tiny_moe(d_model=40, expert_hidden=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "b", dtype="bf16")
