"""QA 119: a new user's first day with moe-train, as the README tells it (prepare-data on awkward text, train,
Ctrl-C and resume, inspect, export-hf, import-hf). What it found, pinned here:
- `moe-train export-hf --help`, `import-hf --help`, `inspect --help` and `prepare-data --help` said nothing of what
  the command does (only train, info and bench had a description), and prepare-data's `inputs` did not say which
  files a folder contributes;
- a folder's NOTES.TXT or README.MD (a Windows copy) was left out without a word, as only the lowercase suffixes
  counted: a folder of them alone was "0 given, expected .txt, .md or .py files";
- prepare-data's summary said "(1 documents)"."""

from __future__ import annotations

import pytest

from moe_train import cli
from moe_train.data import text_file_documents


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # whatever the terminal's width


@pytest.mark.parametrize("command,says", [
    ("export-hf", "export a checkpoint to a Hugging Face folder that stock transformers loads"),
    ("import-hf", "convert a Hugging Face folder to our config.json"),
    ("inspect", "list a checkpoint's tensors, shapes and the layout that wrote it"),
    ("prepare-data", "tokenize text files into a data folder"),
    ("train", "train a model"),
])
def test_help_of_each_command_says_what_it_does(command, says, capsys):
    text = _help(command, capsys)
    usage, _, rest = text.partition(" positional arguments:" if "positional" in text else " options:")
    assert says in usage, text  # the description, between the usage and the arguments


def test_prepare_data_help_names_the_files_a_folder_gives(capsys):
    assert "a folder: its *.txt, *.md and *.py files" in _help("prepare-data", capsys)


def test_a_folder_gives_its_text_files_whatever_the_suffix_case(tmp_path):
    (tmp_path / "NOTES.TXT").write_text("upper")
    (tmp_path / "README.Md").write_text("mixed")
    (tmp_path / "a.txt").write_text("lower")
    (tmp_path / "data.csv").write_text("not text we read")
    assert sorted(text_file_documents([str(tmp_path)])) == ["lower", "mixed", "upper"]


def test_prepare_data_summary_counts_one_document_in_the_singular(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world")
    assert cli.main(["prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "data")]) == 0
    out = capsys.readouterr().out
    assert "train tokens (1 document)," in out, out


def test_a_folder_gives_no_file_under_a_hidden_name_but_a_hidden_file_named_alone_is_read(tmp_path):
    """A project folder's .venv (every installed package's *.py) or .git was tokenized with the project's text."""
    (tmp_path / "doc.md").write_text("the project's own text")
    for hidden in (".venv/lib/site.py", ".git/notes.txt", "sub/.cache/x.txt", "sub/.draft.md"):
        (tmp_path / hidden).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / hidden).write_text(f"hidden {hidden}")
    (tmp_path / "sub" / "kept.txt").write_text("kept")
    assert sorted(text_file_documents([str(tmp_path)])) == ["kept", "the project's own text"]
    assert list(text_file_documents([str(tmp_path / "sub" / ".draft.md")])) == ["hidden sub/.draft.md"]
    # the input folder itself may have a hidden name
    assert list(text_file_documents([str(tmp_path / ".git")])) == ["hidden .git/notes.txt"]
