"""QA 110: a `moe-train` refusal or warning that comes from a library call names the flag or argument the user typed
(`--vocab-size=10`, `out='x'`, `--tokenizer='t.json'`), not the library's parameter (`vocab_size=10`, `out_dir='x'`,
`tokenizer_json='t.json'`); the library's own messages are unchanged for library callers."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from safetensors.torch import save_file

from moe_train.cli import main
from moe_train.config import Config
from moe_train.config_io import config_from_dict
from moe_train.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:export of .*no tokenizer found")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The smallest checkpoint export-hf reads: model.safetensors + config.json (vocab_size 300)."""
    d = Config().to_dict()
    d["model"].update(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2, num_experts=2, expert_hidden=32,
                      vocab_size=300)
    d["model"]["router"]["top_k"] = 1
    cfg = config_from_dict(d)
    folder = tmp_path_factory.mktemp("qa110") / "ckpt"
    folder.mkdir()
    state = Transformer(cfg.model).state_dict()
    save_file({k: v.contiguous() for k, v in state.items() if not (k == "lm_head.weight" and cfg.model.tie_embeddings)},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    return folder


@pytest.fixture(scope="module")
def hf_folder(checkpoint) -> Path:
    from moe_train.hf_bridge import export_hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf(checkpoint, checkpoint.parent / "hf")
    return checkpoint.parent / "hf"


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("moe-train: error: ") == 1, err
    return err[err.index("moe-train: error: "):]


@pytest.mark.parametrize("size,expected", [("10", "--vocab-size=10: expected >= 257"),
                                           ("2000000", "--vocab-size=2000000: expected <= 1048576")])
def test_prepare_data_names_vocab_size_as_the_flag(size, expected, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world\n")
    err = _refused(["prepare-data", "--out", str(tmp_path / "d"), "--vocab-size", size, str(tmp_path / "a.txt")],
                   capsys)
    assert err.startswith(f"moe-train: error: {expected}") and "\n" not in err, err


def test_prepare_data_warning_names_the_flag_and_keeps_meta_jsons_field(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world, the quick brown fox. " * 5)
    assert main(["prepare-data", "--out", str(tmp_path / "d"), "--vocab-size", "400", str(tmp_path / "a.txt")]) == 0
    got = json.loads((tmp_path / "d" / "meta.json").read_text())["vocab_size"]
    err = capsys.readouterr().err
    assert (f"moe-train: warning: --vocab-size=400 asked for, but the corpus gives only {got} tokens (no more pairs to "
            f"merge); meta.json records vocab_size={got}") in err, err


def test_export_hf_names_out_when_it_is_a_file(checkpoint, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = _refused(["export-hf", str(checkpoint), str(tmp_path / "file")], capsys)
    assert err == (f"moe-train: error: out={str(tmp_path / 'file')!r} is a file; expected a folder to write the "
                   "export into")


def test_export_hf_names_out_when_it_holds_other_files(checkpoint, tmp_path, capsys):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    err = _refused(["export-hf", str(checkpoint), str(tmp_path / "other")], capsys)
    assert err.startswith(f"moe-train: error: out={str(tmp_path / 'other')!r} holds files that are not"), err


def test_export_hf_names_out_when_it_is_the_checkpoint(checkpoint, capsys):
    err = _refused(["export-hf", str(checkpoint), str(checkpoint) + "/"], capsys)
    assert err == (f"moe-train: error: out={str(checkpoint)!r} is the checkpoint being exported: the export would "
                   "replace it; choose another out")


def test_export_hf_names_out_when_it_is_the_current_directory(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = _refused(["export-hf", str(checkpoint), "."], capsys)
    assert err.startswith(f"moe-train: error: out='.' is the current directory ({tmp_path}): the export renames a new "
                          "folder into out's place"), err


def test_export_hf_names_out_through_a_link(checkpoint, tmp_path, capsys):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "other")
    err = _refused(["export-hf", str(checkpoint), str(tmp_path / "link")], capsys)
    assert err.startswith(f"moe-train: error: out={os.path.realpath(tmp_path / 'other')!r} holds files"), err


def test_export_hf_names_tokenizer_when_it_is_missing(checkpoint, tmp_path, capsys):
    err = _refused(["export-hf", str(checkpoint), str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "none.json")],
                   capsys)
    assert err == (f"moe-train: error: --tokenizer={str(tmp_path / 'none.json')!r} is not a file; expected a "
                   "tokenizers tokenizer.json")


def test_export_hf_names_tokenizer_when_its_ids_pass_the_models_vocab(checkpoint, _prepared_data, tmp_path, capsys):
    tokenizer = str(_prepared_data / "tokenizer.json")  # 512 tokens, the model 300
    err = _refused(["export-hf", str(checkpoint), str(tmp_path / "hf"), "--tokenizer", tokenizer], capsys)
    assert err.startswith(f"moe-train: error: --tokenizer={tokenizer!r} has token ids up to 511, but "
                          "model.vocab_size=300: "), err
    assert not (tmp_path / "hf").exists()


def test_import_hf_names_out(hf_folder, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = _refused(["import-hf", str(hf_folder), str(tmp_path / "file")], capsys)
    assert err == (f"moe-train: error: out={str(tmp_path / 'file')!r} is a file; expected a folder (new, or an "
                   "earlier import-hf output)")
    err = _refused(["import-hf", str(hf_folder), str(hf_folder)], capsys)
    assert err.startswith(f"moe-train: error: out={str(hf_folder)!r} is the Hugging Face folder being imported") \
        and err.endswith("choose another out"), err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    err = _refused(["import-hf", str(hf_folder), str(tmp_path / "other")], capsys)
    assert err.startswith(f"moe-train: error: out={str(tmp_path / 'other')!r} holds ['notes.txt'], which import-hf "
                          "does not write"), err


@pytest.mark.parametrize("command", ["import-hf", "export-hf"])
def test_a_restored_earlier_folder_is_warned_of_naming_out(command, checkpoint, hf_folder, tmp_path, capsys):
    """A killed run's `.OUT.old-*` folder, put back where OUT was missing: the warning says `out was missing`."""
    (tmp_path / ".again.old-0123abcd").mkdir()  # the name moe-ckpt <= 0.4.1 gave it
    source = hf_folder if command == "import-hf" else checkpoint
    assert main([command, str(source), str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err
    what = command.removesuffix("-hf")
    assert (f"moe-train: warning: {what} to {str(tmp_path / 'again')!r}: out was missing and .again.old-0123abcd "
            f"beside it held the previous {what}") in err, err
    assert "out_dir" not in err


def test_only_the_parameter_with_the_value_passed_is_renamed():
    """What the user did not type stays as the library wrote it: a field of the same name (`model.vocab_size=`,
    `meta.json records vocab_size=282`), the bare `tokenizer_json=` a library caller passes, a value the library
    chose itself (the run's data folder's tokenizer)."""
    from moe_train.cli_names import EXPORT_NAMES, PREPARE_NAMES, in_typed_names

    passed = {"out_dir": "out/hf/", "dtype": "fp8", "tokenizer_json": None, "max_shard_bytes": 0}
    assert in_typed_names("dtype='fp8': expected one of bf16; max_shard_bytes=0: expected >= 1", EXPORT_NAMES,
                          passed) == "--dtype='fp8': expected one of bf16; --max-shard-bytes=0: expected >= 1"
    assert in_typed_names("out_dir='out/hf' holds x; choose another out_dir", EXPORT_NAMES, passed) \
        == "out='out/hf' holds x; choose another out"
    kept = ("tokenizer_json='runs/data/tokenizer.json' has ids up to 511, but model.vocab_size=300; pass one "
            "(export-hf --tokenizer, or tokenizer_json=); out_dir='elsewhere'; dtype in that dtype")
    assert in_typed_names(kept, EXPORT_NAMES, passed) == kept
    assert in_typed_names("vocab_size=4096 asked for; meta.json records vocab_size=282; model.vocab_size=4096",
                          PREPARE_NAMES, {"vocab_size": 4096}) \
        == "--vocab-size=4096 asked for; meta.json records vocab_size=282; model.vocab_size=4096"
