"""QA 102: the commands a user runs between trainings (info, bench, inspect, export-hf / import-hf, prepare-data) and
train's option parsing, on inputs earlier rounds did not use.

Defects (each test fails before its fix in cli.py / config_io.py):
- a path option typed `--out=~/x` (the shell leaves a `~` after `=` as typed): prepare-data wrote a folder named `~`
  in the current folder while the command it printed trained on the home folder's x (config path fields expand
  `~`), and `--config=~/run.yaml` did not exist;
- an empty value, a YAML boolean or a date where the field takes none was named as Python made it: `steps:` left
  empty in a file gave `train.steps=None` (an empty override was fixed for this before), `steps: yes` gave
  `train.steps=True`, `seed: 2024-01-01` gave `train.seed=datetime.date(2024, 1, 1)`, and a date no calendar
  holds (`--train.seed=2024-13-45`, `run_dir: 2024-13-45`) a ValueError traceback;
- `bench --help` lists what bench refuses, but not --train.init_from, which it refuses too;
- a flag given twice (`--custom-code --custom-code`) was taken, where the README says an option given twice is refused.
"""

import json

import pytest

from moe_train.cli import BENCH_UNREAD, main


def exit_status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_path_option_starting_with_a_tilde_is_the_home_folder_as_a_config_path_is(tmp_path, monkeypatch, capsys):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (home / "run.yaml").write_text("train:\n  steps: 7\n")
    assert exit_status(["info", "--config=~/run.yaml"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["config"]["train"]["steps"] == 7

    (work / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    assert exit_status(["prepare-data", "corpus.txt", "--out=~/data", "--vocab-size", "300"]) == 0
    printed = capsys.readouterr().out
    assert (home / "data" / "meta.json").is_file() and not (work / "~").exists()
    assert f"--data.path={home / 'data'}" in printed  # the folder it wrote, the one the printed command reads


@pytest.mark.parametrize("how,text,message", [
    ("file", "train:\n  steps:\n", "train.steps: the value is empty (YAML reads it as null; config file"),
    ("file", "train:\n  steps: yes\n", "train.steps=yes: expected an integer (YAML reads yes as the boolean true; config file"),
    ("file", "train:\n  seed: 2024-01-01\n", "train.seed=2024-01-01: expected an integer (YAML reads it as a date; config file"),
    ("file", "model:\n  dense_layers:\n    - 0\n    -\n", "model.dense_layers[]: the value is empty (YAML reads it"),
    ("file", "train:\n", "train: the value is empty (YAML reads it as null; config file"),
    ("override", "--model.head_dim=on", "model.head_dim=on: expected an integer (YAML reads on as the boolean true; override --model.head_dim=on, line 1)"),
    ("override", "--train.seed=2024-13-45", "train.seed=2024-13-45: expected an integer (YAML reads it as a date; override --train.seed=2024-13-45, line 1)"),
    ("file", "train:\n  run_dir: 2024-13-45\n", 'train.run_dir: YAML read 2024-13-45 as the date 2024-13-45; quote it'),
])
def test_an_empty_value_a_boolean_or_a_date_a_field_does_not_take_is_named_as_typed(how, text, message, tmp_path, capsys):
    if how == "file":
        (tmp_path / "run.yaml").write_text(text)
        argv = ["info", "--config", str(tmp_path / "run.yaml")]
    else:
        argv = ["info", text]
    assert exit_status(argv) == 2
    line = one_line_error(capsys)
    assert message in line and not any(python in line for python in ("None", "True", "datetime")), line


def test_bench_help_names_every_field_bench_refuses(capsys):
    assert exit_status(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    missing = [key for key in BENCH_UNREAD if f"--{key}" not in text]
    assert not missing, text
    assert exit_status(["bench", "--train.init_from=runs/x"]) == 2
    assert "bench does not read train.init_from" in one_line_error(capsys)


def test_a_flag_given_twice_is_refused_as_any_option_is(tmp_path, capsys):
    status = exit_status(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--custom-code", "--custom-code"])
    assert status == 2 and "argument --custom-code: given twice" in one_line_error(capsys)
    assert not (tmp_path / "hf").exists()


def test_export_hf_of_a_hugging_face_folder_says_to_import_it_first(tmp_path, capsys):
    """export-hf given a Hugging Face folder said only that no reader recognises it."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64}))
    assert main(["export-hf", str(hf), str(tmp_path / "out")]) == 2
    assert "it is a Hugging Face folder: import-hf brings it to moe-train's names first" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
