"""Exporting a state dict under a model config it was not made for: the tensors the config's plan never reads were
silently dropped (a 3-layer model exported as a loadable 2-layer one; an untied head exported as tied). Now refused,
naming the tensors, before anything is written."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from moe_ckpt.hf import HFConversionError, export_hf_folder
from moe_train.config import Config, ModelConfig, RouterConfig, validate
from moe_train.model import Transformer


def model(**overrides) -> Transformer:
    kw = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden=48, num_experts=4,
              expert_hidden=16, qk_norm=True, dense_layers=[0], **overrides)
    torch.manual_seed(0)
    return Transformer(validate(Config(model=ModelConfig(router=RouterConfig(top_k=2), **kw))).model)


def test_a_state_dict_with_layers_the_config_lacks_is_refused_before_writing(tmp_path):
    m = model()
    fewer_layers = {**dataclasses.asdict(m.cfg), "num_layers": 2}
    with pytest.raises(HFConversionError, match=r"11 tensors the model config does not describe, e\.g\. "
                                                r"\['blocks\.2\.[^]]*\] \(num_layers=2"):
        export_hf_folder(fewer_layers, m.state_dict(), tmp_path / "hf", dtype="fp32")
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())


def test_an_untied_head_exported_under_a_tied_config_is_refused(tmp_path):
    m = model(tie_embeddings=False)
    tied = {**dataclasses.asdict(m.cfg), "tie_embeddings": True}
    with pytest.raises(HFConversionError, match=r"lm_head\.weight differs from its embed\.weight.*tie_embeddings=True"):
        export_hf_folder(tied, m.state_dict(), tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf").exists()


def test_a_tied_model_still_exports_its_own_state_dict_and_transformers_generates_the_same(tmp_path):
    transformers = pytest.importorskip("transformers")
    m = model(tie_embeddings=True).eval()
    export_hf_folder(dataclasses.asdict(m.cfg), m.state_dict(), tmp_path / "hf", dtype="fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, m(ids)[0], atol=1e-4, rtol=1e-4)
