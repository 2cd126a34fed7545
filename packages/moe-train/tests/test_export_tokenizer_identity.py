"""export-hf without --tokenizer ships the tokenizer of the run's data folder only when that folder holds the tokens
the checkpoint trained on (the checkpoint's record of its train split: its digest, else its token count). A
relative data.path was taken from the current directory, and a folder re-prepared since was read as it is now: either
way another data folder's tokenizer.json and eos id went into the export without a word (review of 0.27.3). Now
the export warns, naming both splits, and ships neither; from the training directory it ships the run's as before."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import init_from_worker as w  # noqa: E402

from moe_train.data import prepare_data, stdlib_documents  # noqa: E402
from moe_train.hf_bridge import export_hf  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402

OTHER = r"holds other training tokens than the checkpoint was trained on \(its train split is blake2b-"


@pytest.fixture
def run(tmp_path, _prepared_data, monkeypatch) -> Path:
    """A 2-step run in tmp_path/train trained on the relative data.path 'data' (a copy of the session's folder)."""
    train = tmp_path / "train"
    train.mkdir()
    shutil.copytree(_prepared_data, train / "data")
    monkeypatch.chdir(train)
    Trainer(w.config(Path("run"), "data", None, steps=2)).train()
    return train / "run"


def _other_data(folder: Path) -> Path:
    return prepare_data(list(stdlib_documents(60_000)), folder, vocab_size=400, source="other")


def test_from_the_training_directory_the_runs_tokenizer_ships(run, tmp_path, _prepared_data):
    export_hf(run, tmp_path / "hf", dtype="fp32")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (_prepared_data / "tokenizer.json").read_bytes()
    eos = json.loads((_prepared_data / "meta.json").read_text())["eos_id"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == eos


def test_another_directorys_data_folder_of_that_name_is_not_taken(run, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    _other_data(elsewhere / "data")
    monkeypatch.chdir(elsewhere)
    with pytest.warns(UserWarning, match=OTHER) as caught:
        export_hf(run, tmp_path / "hf", dtype="fp32")
    text = next(str(c.message) for c in caught if "other training tokens" in str(c.message))
    assert f"({elsewhere / 'data'})" in text and "the folder gets no tokenizer.json" in text, text
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text()).get("eos_token_id") is None  # not its eos id


def test_a_data_folder_re_prepared_since_is_not_taken(run, tmp_path):
    shutil.rmtree(run.parent / "data")
    _other_data(run.parent / "data")
    with pytest.warns(UserWarning, match=OTHER):
        export_hf(run, tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
