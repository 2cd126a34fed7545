"""QA 48: training semantics as a user who trusts the numbers (data preparation and data folder edges)."""

import pytest

from moe_train.cli import main
from moe_train.data import DataError, train_bpe


@pytest.fixture
def bpe_trainer_must_not_run(monkeypatch):
    """Asking tokenizers for a vocabulary of 10**11 aborts the whole process with a Rust out-of-memory backtrace
    (no Python error to catch); stand in for its trainer so a refusal that comes too late fails the test instead."""
    from moe_train.data import tokenizer

    def refuse(*args, **kwargs):
        raise AssertionError(f"the BPE trainer was asked for vocab_size={kwargs.get('vocab_size')}")

    monkeypatch.setattr(tokenizer.trainers, "BpeTrainer", refuse)


@pytest.mark.parametrize("vocab_size", [2**31, 10**11])
def test_a_bpe_vocabulary_too_large_to_reserve_is_refused_before_the_trainer_runs(bpe_trainer_must_not_run,
                                                                                   vocab_size):
    with pytest.raises(DataError, match=rf"vocab_size={vocab_size}: expected <= 1048576"):
        train_bpe(["def f():\n    return 1\n"], vocab_size)


def test_prepare_data_with_a_huge_vocab_size_exits_2_naming_it_and_writes_nothing(bpe_trainer_must_not_run, tmp_path,
                                                                                  capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 50)
    out = tmp_path / "data"
    assert main(["prepare-data", str(text), "--out", str(out), "--vocab-size", "100000000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-train: error: --vocab-size=100000000000: expected <= 1048576") and "\n" not in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["corpus.txt"]


def test_a_data_path_that_is_a_file_is_named_a_file_not_missing(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n")
    code = main(["train", f"--data.path={text}", f"--train.run_dir={tmp_path / 'run'}", "--train.progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (f"moe-train: error: data.path={str(text)!r} is a file: expected a data folder written by "
                   "`moe-train prepare-data` (run it on the file to make one)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("eval_fraction", [0.0, -0.1, 1.0, float("nan")])
def test_prepare_data_refuses_an_eval_fraction_outside_0_1_before_tokenizing(tmp_path, eval_fraction):
    from moe_train.data import prepare_data

    out = tmp_path / "data"
    with pytest.raises(DataError, match=r"eval_fraction=.*: expected in \(0, 1\)"):
        prepare_data(["def f():\n    return 1\n"] * 20, out, vocab_size=300, eval_fraction=eval_fraction)
    assert not out.exists() and list(tmp_path.iterdir()) == []
