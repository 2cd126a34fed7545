"""export-hf without --tokenizer ships the tokenizer it finds itself (the run's data folder's, or an import-hf
output's own tokenizer.json). When that one does not fit, the refusal names where it came from and how to choose
another; it named `tokenizer_json='…'` / `--tokenizer '…'`, an argument the user never gave. A tokenizer the user
passes is still named as they passed it (test_qa110_cli_names)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from safetensors.torch import save_file

from moe_ckpt.hf import HFConversionError
from moe_train.cli import main
from moe_train.config import Config
from moe_train.config_io import config_from_dict
from moe_train.data import DataError
from moe_train.hf_bridge import export_hf
from moe_train.model import Transformer

HINT = "; pass tokenizer_json= (export-hf --tokenizer) to ship another"


def checkpoint(folder: Path, data_path: str) -> Path:
    """model.safetensors + config.json of a vocab-300 model whose run trained on data_path."""
    d = Config().to_dict()
    d["model"].update(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2, num_experts=2, expert_hidden=32,
                      vocab_size=300)
    d["model"]["router"]["top_k"] = 1
    d["data"]["path"] = data_path
    cfg = config_from_dict(d)
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in Transformer(cfg.model).state_dict().items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    return folder


def test_the_data_folders_tokenizer_too_large_for_the_model_is_named_as_the_runs(_prepared_data, tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "ckpt", str(_prepared_data))  # its tokenizer: 512 ids, the model 300
    tok = str(_prepared_data / "tokenizer.json")
    with pytest.raises(HFConversionError) as caught:
        export_hf(ckpt, tmp_path / "hf")
    text = str(caught.value)
    assert text.startswith(f"the tokenizer of the run's data.path={str(_prepared_data)!r} ({tok!r}, which the export "
                           "picked itself) has token ids up to 511, but model.vocab_size=300"), text
    assert text.endswith(HINT) and "tokenizer_json='" not in text, text
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "moe-train: error: the tokenizer of the run's data.path=" in err and "--tokenizer='" not in err, err
    assert not (tmp_path / "hf").exists()


def test_an_import_hf_outputs_own_damaged_tokenizer_is_named_as_the_checkpoints(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", "default")
    (ckpt / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError) as caught:
        export_hf(ckpt, tmp_path / "hf")
    text = str(caught.value)
    assert text.startswith(f"the checkpoint's own tokenizer.json (written by import-hf) "
                           f"({str(ckpt / 'tokenizer.json')!r}, which the export picked itself): not a Hugging Face "
                           "tokenizer.json"), text
    assert text.endswith(HINT) and "--tokenizer '" not in text, text
    assert not (tmp_path / "hf").exists()


def test_a_tokenizer_passed_by_the_caller_is_still_named_as_passed(_prepared_data, tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", "default")
    tok = tmp_path / "tok.json"
    shutil.copy(_prepared_data / "tokenizer.json", tok)
    with pytest.raises(HFConversionError, match=rf"^tokenizer_json={str(tok)!r} has token ids up to 511") as caught:
        export_hf(ckpt, tmp_path / "hf", tokenizer_json=tok)
    assert not str(caught.value).endswith(HINT)


def test_a_data_folder_whose_meta_json_names_a_tokenizer_that_is_a_folder_is_named_in_the_warning(data_dir, tmp_path):
    """The folder exists and its meta.json names tokenizer.json, now a folder: the warning names meta.json and the
    tokenizer it names; it said "no tokenizer found ... run from the training directory", blaming the directory."""
    (data_dir / "tokenizer.json").unlink()
    (data_dir / "tokenizer.json").mkdir()
    ckpt = checkpoint(tmp_path / "ckpt", str(data_dir))
    with pytest.warns(UserWarning) as caught:
        export_hf(ckpt, tmp_path / "hf")
    text = str(caught[0].message)
    assert (f"{data_dir / 'meta.json'} names the tokenizer {str(data_dir / 'tokenizer.json')!r}, which is a folder; "
            "the folder gets no tokenizer.json") in text and "training directory" not in text, text
    assert not (tmp_path / "hf" / "tokenizer.json").exists()


def test_an_empty_tokenizer_json_is_not_given_for_a_model_as_for_a_checkpoint(tmp_path):
    """tokenizer_json="" counted as not given for a checkpoint but was refused ("'' is not a file") for a model."""
    ckpt = checkpoint(tmp_path / "ckpt", "default")
    with pytest.warns(UserWarning, match="no tokenizer found for data.path='default'"):
        export_hf(ckpt, tmp_path / "from_ckpt", tokenizer_json="")
    cfg = json.loads((ckpt / "config.json").read_text())
    export_hf(Transformer(config_from_dict(cfg).model), tmp_path / "from_model", tokenizer_json="")
    assert not (tmp_path / "from_model" / "tokenizer.json").exists()
