"""What a user gets wrong on the command line: status 2, one line naming the value, nothing written."""

import json
import subprocess
import sys

import pytest

from moe_train import cli
from moe_train.cli import main
from moe_train.presets import PRESETS


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def exit_status(argv) -> int:
    """main's status, or the status argparse exits with."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("args,message", [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "expected a command: one of train, info, bench, export-hf, import-hf, inspect, prepare-data"),
    (["info", "--preset"], "argument --preset: expected one argument"),
    (["bench", "--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
    (["prepare-data"], "the following arguments are required: --out"),
    (["inspect"], "the following arguments are required: checkpoint"),
])
def test_argparse_errors_are_one_line_with_status_2(args, message, capsys):
    assert exit_status(args) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("args,message", [
    (["info", "--model.num_expert=8"], "unknown config key 'model.num_expert'"),
    (["info", "--model.num_experts"], "override '--model.num_experts': expected --model.num_experts=value"),
    (["info", "model.num_experts=8"], "override 'model.num_experts=8': expected --section.field=value"),
    (["info", "--model.router=3"], "model.router=3: expected a mapping of its fields"),
    (["info", "--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
    (["info", "--config", "list.yaml"], "expected a mapping at the top level"),
    (["info", "--config", "folder"], "config file 'folder' is a folder: expected a YAML file"),
    (["info", "--preset", "nope"], "preset='nope': expected one of tiny,"),
    (["bench", "--steps", "0"], "bench --steps=0: expected a positive integer"),
    (["bench", "--steps", "-1"], "bench --steps=-1: expected a positive integer"),
    (["inspect", "folder"], "'folder' holds no checkpoint"),
    (["export-hf", "folder", "out"], "checkpoint 'folder': no reader recognises it"),
    (["import-hf", "folder", "out"], "'folder' has no config.json; expected a Hugging Face model folder"),
])
def test_misuse_exits_2_with_one_line_and_writes_nothing(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.yaml").write_text("- a\n")
    (tmp_path / "folder").mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert exit_status(args) == 2
    assert message in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_an_empty_config_file_is_the_preset(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("")
    assert main(["info", "--config", str(tmp_path / "empty.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["preset"] == "tiny"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_info_runs_for_every_preset(preset, capsys):
    assert main(["info", "--preset", preset]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == preset and out["params_total"] >= out["params_active"] > 0


def test_unknown_subcommand_from_the_shell_is_one_line():
    r = subprocess.run([sys.executable, "-m", "moe_train", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("out,message", [("folder", "is a folder; expected a file path"),
                                         ("nowhere/x.json", "its folder")])
def test_bench_out_is_checked_before_the_run(out, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    monkeypatch.setattr("moe_train.bench.run_bench", lambda *a: pytest.fail("ran the bench with a bad --out"))
    assert main(["bench", "--out", out]) == 2
    assert f"bench --out={out}: {message}" in one_line_error(capsys)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("value", ["0", "-5"])
def test_prepare_data_refuses_max_bytes_below_one(value, tmp_path, capsys):
    assert main(["prepare-data", "--out", str(tmp_path / "d"), "--max-bytes", value]) == 2
    assert f"--max-bytes={value}: expected a positive number of bytes" in one_line_error(capsys)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("word,value", [("false", False), ("true", True)])
def test_resume_with_a_value_sets_train_resume(word, value, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(f"train:\n  resume: {str(not value).lower()}\n")  # the opposite, replaced
    assert main(["info", "--config", str(tmp_path / "c.yaml"), f"--resume={word}"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["train"]["resume"] is value


def test_resume_with_a_bad_value_names_train_resume(capsys):
    assert main(["info", "--resume=3"]) == 2
    assert "train.resume=3: expected true or false" in one_line_error(capsys)


@pytest.mark.parametrize("command,options", [
    ("train", ["--preset", "--config", "--section.field=value", "--resume", "--steps N", "--run-dir"]),
    ("info", ["--preset", "--config", "--section.field=value"]),
    ("bench", ["--preset", "--config", "--steps STEPS measured", "--warmup WARMUP unmeasured", "--out",
               "--section.field=value"]),
    ("export-hf", ["checkpoint", "out the Hugging Face folder", "--dtype", "--max-shard-bytes SIZE", "--push-to-hub",
                   "--allow-benchmark-routing"]),
    ("import-hf", ["folder a Hugging Face model folder", "out the folder to write"]),
    ("inspect", ["checkpoint"]),
    ("prepare-data", ["inputs", "--out OUT the data folder", "--vocab-size", "--tokenizer", "--max-bytes"]),
])
def test_help_of_each_command_describes_its_options(command, options, capsys):
    assert exit_status([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # whatever the terminal's width
    for option in options:
        assert option in text, (option, text)
    assert set(cli._parser().commands) == {"train", "info", "bench", "export-hf", "import-hf", "inspect",
                                          "prepare-data"}


@pytest.mark.parametrize("command", [["export-hf", "run", "out"], ["import-hf", "hf", "out"],
                                     ["prepare-data", "--out", "d"], ["inspect", "run"]])
def test_an_override_to_a_command_without_config_says_where_overrides_apply(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--model.num_experts=3"]) == 2
    line = one_line_error(capsys)
    assert "unknown arguments ['--model.num_experts=3']" in line
    assert "config overrides apply to train, info and bench" in line
    assert list(tmp_path.iterdir()) == []


def test_a_run_dir_that_is_a_file_is_one_line_naming_the_field(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["train", f"--train.run_dir={tmp_path / 'afile'}", "--train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.run_dir=" in err and "is a file: expected a folder" in err and "\n" not in err
    assert (tmp_path / "afile").read_text() == "x"
