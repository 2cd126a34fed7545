"""QA pass 33: export-hf never replaces the checkpoint it reads; a sharded folder whose index disagrees with
its shard files is refused by name before any tensor is converted."""

from __future__ import annotations

import json
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_ckpt.hf import HFConversionError, open_hf_folder
from moe_train.cli import main
from moe_train.config import Config, ModelConfig, RouterConfig, validate
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer


def small_config() -> Config:
    return validate(Config(model=ModelConfig(vocab_size=64, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                             dense_hidden=32, num_experts=4, expert_hidden=16, qk_norm=True,
                                             router=RouterConfig(top_k=2))))


def safetensors_checkpoint(folder) -> dict[str, torch.Tensor]:
    """The model.safetensors + config.json checkpoint layout export_hf reads (our names, fp32)."""
    cfg = small_config()
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in Transformer(cfg.model).state_dict().items()}
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    return state


def test_export_into_the_checkpoint_folder_it_reads_is_refused_and_the_checkpoint_kept(tmp_path):
    """Before: `export-hf ckpt ckpt` passed the out_dir check (config.json and model.safetensors are names an
    export writes), wrote the export and renamed it over the source: the fp32 checkpoint (our names, our
    config) was silently replaced by a bf16 Hugging Face folder."""
    ckpt = tmp_path / "ckpt"
    state = safetensors_checkpoint(ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer
        with pytest.raises(HFConversionError, match=r"out_dir=.*ckpt.* is the checkpoint being exported"):
            export_hf(ckpt, ckpt, dtype="bf16")
        with pytest.raises(HFConversionError, match=r"is the checkpoint being exported"):
            export_hf(ckpt / ".", tmp_path / "ckpt", dtype="bf16")  # spelled another way: still the same folder
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")]  # nothing left beside it
    got = load_file(str(ckpt / "model.safetensors"))
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


def test_export_hf_cli_into_its_own_checkpoint_exits_2_naming_it(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    safetensors_checkpoint(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["export-hf", str(ckpt), str(ckpt)]) == 2
    assert "is the checkpoint being exported" in capsys.readouterr().err
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "generation_config.json").exists()


@pytest.fixture
def sharded(tmp_path):
    cfg = small_config()
    torch.manual_seed(0)
    export_hf(Transformer(cfg.model), tmp_path / "hf", dtype="fp32", max_shard_bytes=4096)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    return tmp_path / "hf", index


def _write_index(folder, index) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


NAME = "model.layers.0.self_attn.q_proj.weight"


def test_a_tensor_the_index_does_not_list_is_refused_naming_it_and_the_index(sharded, tmp_path):
    """Before: open_hf_folder checked names against the shard files only, so the import failed half-way with a
    bare KeyError (transformers, which follows weight_map, would leave that weight uninitialised)."""
    folder, index = sharded
    stored_in = index["weight_map"].pop(NAME)
    _write_index(folder, index)
    with pytest.raises(HFConversionError, match=rf"model.safetensors.index.json does not list tensor {NAME}, "
                                                rf"which {stored_in} holds"):
        open_hf_folder(folder)
    with pytest.raises(HFConversionError, match=NAME):
        import_hf(folder, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_a_tensor_the_index_places_in_the_wrong_shard_is_refused_naming_both_files(sharded, tmp_path):
    """Before: SafetensorError 'File does not contain tensor ...' from the middle of the import."""
    folder, index = sharded
    stored_in = index["weight_map"][NAME]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != stored_in)
    index["weight_map"][NAME] = other
    _write_index(folder, index)
    with pytest.raises(HFConversionError, match=rf"model.safetensors.index.json maps tensor {NAME} to {other}, "
                                                rf"which does not hold it; {stored_in} does"):
        open_hf_folder(folder)


def test_a_tensor_stored_in_no_shard_is_still_named_as_missing(sharded):
    folder, index = sharded
    file = folder / index["weight_map"][NAME]
    tensors = load_file(str(file))
    del tensors[NAME]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match=rf"tensor {NAME} \(shape \[16, 16\]\) is missing from"):
        open_hf_folder(folder)


def test_an_intact_sharded_folder_still_imports(sharded, tmp_path):
    folder, _ = sharded
    cfg, state = import_hf(folder, tmp_path / "ours")
    assert cfg.model.num_experts == 4 and NAME.replace("model.layers.0.self_attn", "blocks.0.attn") in state
