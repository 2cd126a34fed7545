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


def test_inspect_describes_an_import_hf_output_as_export_hf_reads_it(tmp_path, capsys):
    """`moe-train inspect` of a model.safetensors + config.json folder (import-hf's output) was refused as holding no
    checkpoint, while export-hf and train.init_from read it: it now lists the network and the tensors."""
    import json

    from safetensors.torch import save_file

    from moe_train.config import Config
    from moe_train.config_io import config_from_dict
    from moe_train.model import Transformer

    d = Config().to_dict()
    d["model"].update(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2, num_experts=2, expert_hidden=32,
                      vocab_size=300)
    d["model"]["router"]["top_k"] = 1
    cfg = config_from_dict(d)
    folder = tmp_path / "imported"
    folder.mkdir()
    state = {k: v.contiguous() for k, v in Transformer(cfg.model).state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert cli.main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"model folder {folder}: {len(state)} tensors, ") and "import-hf" in out[0], out[0]
    assert out[1] == "network: num_layers=1, d_model=32, num_experts=2, vocab_size=300", out[1]
    assert any(line.split()[:1] == ["embed.weight"] and "(300, 32)" in line for line in out[2:]), out
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    assert cli.main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-train: error: {str(folder)!r}: its config.json or model.safetensors cannot be read"), err
