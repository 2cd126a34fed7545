"""QA 108: a resume notices when its training data is not the data the checkpoint was trained on.

prepare-data records each split's token-file digest in meta.json, the checkpoint records the train split's identity
(digest and token count; the count alone for a folder prepared before digests), and a resume on other tokens with
the same window count (a folder re-prepared from other text) warns once, naming data.path and both identities. The
same tokens, an old checkpoint (no identity) and an old folder (no digest) resume without it."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest

from moe_ckpt import load_metadata
from moe_train.cli import main
from moe_train.config_io import config_from_dict
from moe_train.data import prepare_data, stdlib_documents
from moe_train.trainer.loop import Trainer
from moe_train.trainer.resume_checks import train_data_change
from metadata_edit import rewrite_metadata  # noqa: E402

OLD_RUNS = Path(__file__).parent / "data" / "old_runs"
DATA_WORDS = ("training data", "data.path")


def _blake2b_256(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "blake2b-" + h.hexdigest()


def _train_then_resume(tmp_path, make_config, first_data: Path, resumed_data: Path) -> list[str]:
    """Train 2 steps on first_data (a checkpoint at step 2), then restore it on resumed_data: the warnings."""
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)
    cfg.data.path = str(first_data)
    Trainer(cfg).train()
    again = make_config(tmp_path, steps=3, eval_interval=0, save_interval=0)
    again.data.path = str(resumed_data)
    t = Trainer(again)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.restore(t.resume_point())
    return [str(w.message) for w in caught]


def _reprepared(data_dir: Path, out: Path, reorder: bool) -> Path:
    """data_dir's documents prepared again with its tokenizer.json: in the same order (the same tokens), or in
    reverse (other tokens, but as many: each split has the same blocks, so the same window count)."""
    docs = list(stdlib_documents(200_000))  # the data_dir fixture's documents
    return prepare_data(docs[::-1] if reorder else docs, out, tokenizer_path=str(data_dir / "tokenizer.json"),
                        source="stdlib-test")


def test_prepare_data_records_the_digest_of_each_splits_token_file(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    for name in ("train", "eval"):
        assert meta["splits"][name]["digest"] == _blake2b_256(data_dir / f"{name}.u32"), name
    assert meta["format"] == "moe-train-tokens/1" and meta["splits"]["train"]["max_token_id"] >= 0


def test_a_checkpoint_records_the_train_split_it_was_trained_on_and_inspect_shows_it(tmp_path, data_dir, make_config,
                                                                                     capsys):
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    split = json.loads((data_dir / "meta.json").read_text())["splits"]["train"]
    saved = load_metadata(tmp_path / "run" / "checkpoints" / "step-00000002")
    assert saved["train_data"] == {"num_tokens": split["num_tokens"], "digest": split["digest"]}
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:4] == ["step: 2", f"train data: {split['digest'][:20]}… ({split['num_tokens']:,} tokens)"], lines[:4]


def test_a_resume_on_a_reprepared_folder_with_the_same_window_count_warns_once_naming_both(tmp_path, data_dir,
                                                                                           make_config):
    other = _reprepared(data_dir, tmp_path / "other", reorder=True)
    before = json.loads((data_dir / "meta.json").read_text())["splits"]["train"]
    now = json.loads((other / "meta.json").read_text())["splits"]["train"]
    assert now["num_tokens"] == before["num_tokens"] and now["digest"] != before["digest"]  # only the tokens differ
    got = [m for m in _train_then_resume(tmp_path, make_config, data_dir, other) if "training data" in m]
    assert len(got) == 1, got
    assert got[0].startswith(f"data.path={str(other)!r} is not the training data the checkpoint was trained on "
                             f"(its train split is {now['digest'][:20]}… ({now['num_tokens']:,} tokens), the "
                             f"checkpoint's was {before['digest'][:20]}… ({before['num_tokens']:,} tokens)"), got[0]
    assert "the sample order goes on from sample 16 over this data's windows" in got[0], got[0]


def test_a_resume_on_the_same_tokens_prepared_again_says_nothing_about_the_data(tmp_path, data_dir, make_config):
    again = _reprepared(data_dir, tmp_path / "again", reorder=False)
    assert (again / "train.u32").read_bytes() == (data_dir / "train.u32").read_bytes()
    got = _train_then_resume(tmp_path, make_config, data_dir, again)
    assert not [m for m in got if any(w in m for w in DATA_WORDS)], got


def test_a_checkpoint_that_records_no_data_resumes_on_other_tokens_without_a_warning(tmp_path, data_dir,
                                                                                      make_config):
    """A checkpoint saved before the trainer recorded its data (its metadata.json without train_data): nothing to
    compare, so a resume on other tokens with the same window count says nothing about the data, as before."""
    other = _reprepared(data_dir, tmp_path / "other", reorder=True)
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    saved = tmp_path / "run" / "checkpoints" / "step-00000002" / "metadata.json"
    meta = json.loads(saved.read_text())
    del meta["train_data"]
    rewrite_metadata(saved, meta)
    again = make_config(tmp_path, steps=3, eval_interval=0, save_interval=0)
    again.data.path = str(other)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Trainer(again).train()["step"] == 3
    assert not [str(w.message) for w in caught if any(word in str(w.message) for word in DATA_WORDS)]


def test_an_old_run_on_an_old_data_folder_resumes_and_records_the_folder_by_its_token_count(old_run_0_5):
    """moe-train 0.5.0's run and data folder (no digest, no recorded data): it resumes and trains, saying nothing
    about the data, and its new checkpoint records the folder by its token count."""
    run, data = old_run_0_5
    cfg = config_from_dict(json.loads((run / "checkpoints/step-00000004/metadata.json").read_text())["config"])
    cfg.train.steps = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Trainer(cfg).train()["step"] == 5
    assert not [str(w.message) for w in caught if any(word in str(w.message) for word in DATA_WORDS)]
    num_tokens = json.loads((data / "meta.json").read_text())["splits"]["train"]["num_tokens"]
    assert load_metadata(run / "checkpoints/step-00000005")["train_data"] == {"num_tokens": num_tokens}


def test_without_digests_another_token_count_with_the_same_windows_warns():
    """A folder prepared before digests: its token count tells it apart, even where the window count is equal."""
    saved = {"sampler": {"samples_seen": 8, "seed": 0, "seq_len": 16, "num_windows": 62},
             "train_data": {"num_tokens": 1000}}
    got = train_data_change(saved, 62, {"num_tokens": 1001}, "data", 0)
    assert got is not None and got.startswith("data.path='data' is not the training data the checkpoint was trained "
                                              "on (its train split is 1,001 tokens, no digest, the checkpoint's was "
                                              "1,000 tokens, no digest; data.path changed or re-prepared)"), got
    assert train_data_change(saved, 62, {"num_tokens": 1000, "digest": "blake2b-00"}, "data", 0) is None


@pytest.fixture
def old_run_0_5(tmp_path, monkeypatch):
    """A copy of moe-train 0.5.0's run folder and data folder (tests/data/old_runs), the cwd set so its relative
    data.path and train.run_dir name the copies."""
    monkeypatch.chdir(tmp_path)
    data = Path(shutil.copytree(OLD_RUNS / "data", tmp_path / "data"))
    return Path(shutil.copytree(OLD_RUNS / "0.5.0", tmp_path / "0.5.0")), data
