"""What the HF import/export tests share: logits from transformers and from our model on the same tokens,
a folder's tensors, tiny models with every tensor random, greedy decoding with our model, one torch thread for the
module (the comparisons are fp32 and small), and, for custom-code folders, transformers' caches kept out of the home
folder (hf_home)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_train.config import Config, ModelConfig, RouterConfig, validate
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


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """transformers' caches in a temporary folder, never under the home folder: HF_MODULES_CACHE (the copied modeling
    files of a custom-code folder) is read when transformers is imported, so it is also patched where it is used.
    The package transformers_modules stays bound to the module cache it was first imported from, so it is forgotten
    before and after the module: each module's hf_home serves its own."""
    home = tmp_path_factory.mktemp("hf_home")

    def forget():
        for name in [n for n in sys.modules if n.split(".")[0] == "transformers_modules"]:
            del sys.modules[name]

    forget()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_MODULES_CACHE", str(home / "modules"))
        mp.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(home / "modules"))
        mp.setattr(sys, "path", list(sys.path))  # transformers appends the modules folder
        yield home
    forget()


def random_model(base: dict, overrides: dict, seed: int) -> Transformer:
    """A tiny fp32 model of base + overrides (a "router" dict for RouterConfig) whose every tensor is random: norms
    around 1, biases, gates and expert biases non-zero, so a conversion that drops or misplaces one shows."""
    kw = {**base, **overrides}
    cfg = validate(Config(model=ModelConfig(router=RouterConfig(**kw.pop("router", {})), **kw))).model
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.copy_(1.0 + 0.3 * torch.randn_like(t))
            elif name.endswith((".bias", "expert_bias")) or "shared_expert_gate" in name:
                t.copy_(0.2 * torch.randn_like(t))
    return model.eval()


def our_greedy(model: Transformer, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding with our model, the whole sequence recomputed each step (no cache)."""
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids
