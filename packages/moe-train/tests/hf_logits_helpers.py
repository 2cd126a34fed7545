"""What the HF import/export tests share: logits from transformers and from our model on the same tokens,
a folder's tensors, and one torch thread for the module (the comparisons are fp32 and small)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_train.config import ModelConfig
from moe_train.model import Transformer

transformers = pytest.importorskip("transformers")  # the importing test module skips without it


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits of the folder's model on ids [B, S]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def our_logits(model_cfg: ModelConfig, state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Our model's logits on ids with the given state dict (strict)."""
    model = Transformer(model_cfg)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model.eval()(ids)[0]


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, by name."""
    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
