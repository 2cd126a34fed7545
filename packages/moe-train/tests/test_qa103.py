"""QA 103: a newcomer follows the READMEs on a fresh clone (train, inspect, export-hf, import-hf, init_from,
prepare-data, info, bench).

Defect (the test fails before its fix in hf_bridge.py):
- `export-hf hf/e16 out` of the folder an earlier export-hf wrote (model.safetensors + a Hugging Face config.json)
  said only "expected config.json (Config.to_dict()) or a state.json ...": the import-hf hint of moe-train 0.19.9
  was reached only by a folder without model.safetensors (a sharded one), not by the single-file folder export-hf
  itself writes.
"""

import json

import torch
from safetensors.torch import save_file

from moe_train.cli import main


def test_export_hf_of_a_single_file_hugging_face_folder_says_to_import_it_first(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 8}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)}, str(hf / "model.safetensors"))
    assert main(["export-hf", str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert "it is a Hugging Face folder: import-hf brings it to moe-train's names first" in err, err
    assert not (tmp_path / "out").exists()


def test_export_hf_of_a_folder_whose_config_json_is_not_an_object_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("5")
    assert main(["export-hf", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-train: error: ") and "\n" not in err, err
