"""QA 113: an independent review of QA 108-111, by trying to break them. Each test here failed before its fix."""

from __future__ import annotations

import pytest

from moe_train.cli import main


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("moe-train: error: ") == 1, err
    return err[err.index("moe-train: error: "):]


def test_a_path_holding_a_parameter_name_is_left_as_typed(tmp_path, monkeypatch, capsys):
    """cli_names renames a library parameter (`out_dir`, `eos_token`) to the flag typed, but never inside a path: a
    folder called out_dir or eos_token is the user's name (it became `out='out'` and `'--eos-token/missing.json'`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out_dir").write_text("a file")
    (tmp_path / "hf").mkdir()
    (tmp_path / "eos_token").mkdir()
    (tmp_path / "doc.txt").write_text("some text\n")
    assert _refused(["import-hf", "hf", "out_dir"], capsys).startswith("moe-train: error: out='out_dir' is a file")
    err = _refused(["import-hf", "hf", str(tmp_path / "out_dir")], capsys)
    assert f"out={str(tmp_path / 'out_dir')!r} is a file" in err, err
    err = _refused(["prepare-data", "--out", "data", "--tokenizer", "eos_token/missing.json", "doc.txt"], capsys)
    assert "'eos_token/missing.json' does not exist" in err, err


@pytest.mark.parametrize("name", ["eos_token.txt", "tokenizer_path"])
def test_an_input_file_named_like_a_parameter_is_named_as_given(tmp_path, monkeypatch, capsys, name):
    """An input prepare-data cannot read is named as given (it became '--eos-token.txt' and '--tokenizer')."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(b"\xff text")
    err = _refused(["prepare-data", "--out", "data", name], capsys)
    assert err.startswith(f"moe-train: error: {name!r} is not UTF-8 text"), err


def test_a_parameter_name_inside_another_path_is_not_renamed():
    from moe_train.cli_names import EXPORT_NAMES, in_typed_names

    message = "checkpoint runs/out_dir=a/step_1 holds x; shard file /d/max_shard_bytes/f; out_dir='a' is a file"
    assert in_typed_names(message, EXPORT_NAMES, {"out_dir": "a", "max_shard_bytes": 5}) \
        == "checkpoint runs/out_dir=a/step_1 holds x; shard file /d/max_shard_bytes/f; out='a' is a file"


@pytest.mark.parametrize("field,value", [("pp", 0), ("dp", 0), ("pp", "1"), ("dp", "2")])
def test_a_hand_built_layout_that_is_no_count_is_named_not_multiplied(monkeypatch, field, value):
    """make_runtime (the Trainer's and run_bench's) with a Config built by hand, which validate(cfg) has not seen:
    a dp or pp that is not a positive integer is named, as moe_parallel did before _check_layout multiplied it
    (pp=0 was a ZeroDivisionError, dp=0 said 'launch 0 processes', pp='1' a TypeError)."""
    import torch

    from moe_train.config import Config, ConfigError
    from moe_train.trainer.launch import make_runtime

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = Config()
    setattr(cfg.parallel, field, value)
    with pytest.raises(ConfigError, match=rf"^parallel layout: parallel\.{field}={value!r} must be a positive integer"):
        make_runtime(cfg, torch.device("cpu"))
