"""A tied-embedding Hugging Face folder that also stores lm_head.weight (some save paths write both): imported
when the two are equal, refused naming both tensors and the fix when they differ (transformers 5 then unties
them, transformers 4 ties them: two different models). It used to be refused as an unexpected tensor either way."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_ckpt.hf import HFConversionError, open_hf_folder

transformers = pytest.importorskip("transformers")


@pytest.fixture
def tied_folder(tmp_path):
    """A tiny tied Qwen3-MoE written by transformers' save_pretrained (which leaves lm_head.weight out)."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def add_head(folder, head: torch.Tensor | None = None) -> torch.Tensor:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.clone() if head is None else head
    save_file(tensors, str(path), metadata={"format": "pt"})
    return embed


def test_a_tied_folder_whose_lm_head_equals_the_embedding_imports_tied(tied_folder):
    embed = add_head(tied_folder)
    hf = open_hf_folder(tied_folder)
    assert hf.model_config["tie_embeddings"] is True
    ours = hf.state_dict()
    assert torch.equal(ours["embed.weight"], embed.float()) and torch.equal(ours["lm_head.weight"], embed.float())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tied_folder)  # what transformers makes of it: tied
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)


def test_a_tied_folder_whose_lm_head_differs_is_refused_naming_both_and_the_fix(tied_folder):
    embed = load_file(str(tied_folder / "model.safetensors"))["model.embed_tokens.weight"]
    head = embed.clone()
    head[37, 5] += 0.25
    add_head(tied_folder, head)
    with pytest.raises(HFConversionError, match=r"tie_word_embeddings=true, but the folder's lm_head\.weight differs "
                                                r"from model\.embed_tokens\.weight \(max \|difference\| 0\.25"):
        open_hf_folder(tied_folder)


def test_a_tied_folder_whose_lm_head_has_another_shape_is_refused_naming_both_shapes(tied_folder):
    add_head(tied_folder, torch.zeros(63, 32))
    with pytest.raises(HFConversionError, match=r"lm_head\.weight has shape \[63, 32\], expected \[64, 32\]"):
        open_hf_folder(tied_folder)


def test_a_head_that_differs_only_in_the_last_chunk_is_refused(tied_folder, monkeypatch):
    """QA 150 (mutation audit, review helper 163): the check compares _ROWS_PER_COMPARE (4096) rows at a time and
    the vocabularies here (64) fit in one chunk, so a loop over the first chunk only passed: a head that differs past
    row 4096 (every real vocabulary has more) would be imported as tied, dropping the folder's own head."""
    import moe_ckpt.hf.load as hf_load

    monkeypatch.setattr(hf_load, "_ROWS_PER_COMPARE", 8)  # 8 chunks of the 64-row vocabulary
    head = load_file(str(tied_folder / "model.safetensors"))["model.embed_tokens.weight"].clone()
    head[61, 3] += 0.5
    add_head(tied_folder, head)
    with pytest.raises(HFConversionError,
                       match=r"lm_head\.weight differs from model\.embed_tokens\.weight .*from row 56"):
        open_hf_folder(tied_folder)
