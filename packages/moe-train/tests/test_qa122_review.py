"""QA 122: the later changes of 0.21.14-0.21.18 pushed at their edges; each test failed before its fix.

- prepare-data left a folder's files under hidden names out without a word: a folder whose text is all under
  .something said only 'no documents to tokenize: 0 given' (now a warning names the count and one of them);
- inspect called a Hugging Face model folder 'as import-hf writes; export-hf and train.init_from read it' (both
  refuse it), and a sharded one 'holds no checkpoint'; a config.json of {"model": null} was a TypeError traceback;
- the later-checkpoints refusal said a save at an existing step 'writes over it': moe_ckpt refuses to (the save
  fails, after the training up to it), and train.keep_last deletes this run's saves, not the later ones.
"""

from __future__ import annotations

import json

import pytest
import torch
from moe_ckpt import Box, ShardSpec, save_checkpoint
from safetensors.torch import save_file

from moe_train import cli
from moe_train.config_io import ConfigError
from moe_train.data.corpus import text_file_documents
from moe_train.trainer.resume_checks import check_no_checkpoints_after


def test_a_folder_says_how_many_files_under_hidden_names_it_left_out(tmp_path):
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    for name in ("a.py", "b.py"):
        (tmp_path / ".venv" / "lib" / name).write_text("installed source")
    with pytest.warns(UserWarning, match=r"2 text files under a hidden name left out \(e\.g\. .*\.venv/lib/a\.py\)"):
        assert list(text_file_documents([str(tmp_path)])) == []
    (tmp_path / "kept.md").write_text("kept")
    with pytest.warns(UserWarning, match="2 text files under a hidden name left out"):
        assert list(text_file_documents([str(tmp_path)])) == ["kept"]


def test_prepare_data_of_a_folder_with_only_hidden_text_names_what_was_left_out(tmp_path, capsys):
    (tmp_path / "corpus" / ".drafts").mkdir(parents=True)
    (tmp_path / "corpus" / ".drafts" / "notes.txt").write_text("all the text there is")
    assert cli.main(["prepare-data", str(tmp_path / "corpus"), "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "1 text file under a hidden name left out" in err and "notes.txt" in err, err


def _hf_folder(folder, sharded: bool):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "hidden_size": 8}))
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] if sharded else ["model.safetensors"]
    for i, name in enumerate(names):
        save_file({f"w{i}": torch.zeros(2, 2)}, str(folder / name))
    if sharded:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w0": names[0], "w1": names[1]}}))


@pytest.mark.parametrize("sharded", [False, True])
def test_inspect_of_a_hugging_face_folder_points_at_import_hf_and_claims_no_import(tmp_path, capsys, sharded):
    _hf_folder(tmp_path / "hf", sharded)
    assert cli.main(["inspect", str(tmp_path / "hf")]) == 2
    captured = capsys.readouterr()
    assert "as import-hf writes" not in captured.out, captured.out
    assert "is a Hugging Face model folder (config.json model_type='qwen2_moe')" in captured.err, captured.err
    assert f"moe-train import-hf {tmp_path / 'hf'} OUT" in captured.err, captured.err


def test_inspect_of_a_model_folder_whose_model_section_is_null_lists_its_tensors(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    save_file({"embed.weight": torch.zeros(3, 2)}, str(tmp_path / "m" / "model.safetensors"))
    (tmp_path / "m" / "config.json").write_text('{"model": null}')
    assert cli.main(["inspect", str(tmp_path / "m")]) == 0
    assert "network: (no model section in config.json)" in capsys.readouterr().out


def test_the_later_checkpoints_refusal_says_a_save_there_fails_as_moe_ckpt_does(tmp_path):
    later = tmp_path / "checkpoints" / "step-00000005"
    spec = [ShardSpec("w", (2,), torch.zeros(2), Box((0,), (2,)))]
    save_checkpoint(later, spec)
    with pytest.raises(FileExistsError, match="already exists"):  # what a save at that step meets
        save_checkpoint(later, spec)
    with pytest.raises(ConfigError) as refused:
        check_no_checkpoints_after(tmp_path, 0, resume=False)
    assert "writes over" not in str(refused.value) and "a save at one of those steps fails" in str(refused.value)
    assert "delete this run's own saves" in str(refused.value)
