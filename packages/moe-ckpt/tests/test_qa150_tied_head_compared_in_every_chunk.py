"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

The tied-head check compares lm_head.weight with the embedding _ROWS_PER_COMPARE (4096) rows at a time; the
tested vocabularies (64) fit in one chunk, so a loop over the first chunk only passed: a head that differs past row
4096 (every real vocabulary has more) would be imported as tied, dropping the folder's own head."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_ckpt.hf.load as hf_load
from moe_ckpt.hf import HFConversionError, open_hf_folder

transformers = pytest.importorskip("transformers")


@pytest.fixture
def tied_folder(tmp_path):
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_a_head_that_differs_only_in_the_last_chunk_is_refused(tied_folder, monkeypatch):
    monkeypatch.setattr(hf_load, "_ROWS_PER_COMPARE", 8)  # 8 chunks of the 64-row vocabulary
    path = tied_folder / "model.safetensors"
    tensors = load_file(str(path))
    head = tensors["model.embed_tokens.weight"].clone()
    head[61, 3] += 0.5
    tensors["lm_head.weight"] = head
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(HFConversionError,
                       match=r"lm_head\.weight differs from model\.embed_tokens\.weight .*from row 56"):
        open_hf_folder(tied_folder)
