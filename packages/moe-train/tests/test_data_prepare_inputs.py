"""`prepare-data` on inputs that are not plain, ample UTF-8 text: each is refused with one line naming
the value and what was expected (exit 2), or handled as documented."""

import json
import warnings

import numpy as np
import pytest
from tokenizers import Tokenizer

from moe_train.cli import main
from moe_train.data import DataError, open_data, prepare_data, text_file_documents
from moe_train.data.prepare import EOS, eval_blocks

TEXT = "".join(f"def f{i}(x):\n    return x * {i}  # the quick brown fox\n\n" for i in range(200))


def error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("content", [b"", b"   \n\t\n  "])
def test_prepare_refuses_inputs_that_are_empty_or_whitespace(content, tmp_path, capsys):
    """They used to make an EOS-only corpus: a traceback (empty) or a folder of 1+1 tokens (whitespace)."""
    (tmp_path / "in.txt").write_bytes(content)
    line = error_line(capsys, ["prepare-data", str(tmp_path / "in.txt"), "--out", str(tmp_path / "d")])
    assert "no documents to tokenize: 1 given, all empty or whitespace" in line
    assert not (tmp_path / "d").exists()


def test_empty_documents_are_left_out_of_the_corpus(tmp_path, data_dir):
    tok = str(data_dir / "tokenizer.json")
    a = json.loads((prepare_data([TEXT], tmp_path / "a", tokenizer_path=tok) / "meta.json").read_text())
    b = json.loads((prepare_data(["", TEXT, " \n"], tmp_path / "b", tokenizer_path=tok) / "meta.json").read_text())
    assert a["splits"] == b["splits"] and a["corpus_sha256_16"] == b["corpus_sha256_16"]


def test_a_corpus_too_small_to_split_is_a_data_error_not_a_traceback():
    """It was a bare ValueError: a traceback from the command line instead of one line and exit 2."""
    with pytest.raises(DataError, match=r"the corpus is 1 token .* too few to hold out an eval split"):
        eval_blocks(1, 0.02, 2048)


def test_prepare_refuses_a_file_that_is_not_utf8_naming_it_and_the_byte(tmp_path, capsys):
    """Binary or Latin-1 input used to be read with errors='replace': U+FFFD garbage trained silently."""
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text(TEXT)
    bad.write_bytes(b"caf\xe9 au lait\n" * 10)
    line = error_line(capsys, ["prepare-data", str(good), str(bad), "--out", str(tmp_path / "d")])
    assert f"{str(bad)!r} is not UTF-8 text (byte 0xe9 at offset 3)" in line
    assert not (tmp_path / "d").exists()


def test_a_file_named_twice_or_also_through_its_folder_is_read_once(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("alpha")
    (tmp_path / "c" / "b.md").write_text("beta")
    paths = [str(tmp_path / "c" / "a.txt"), str(tmp_path / "c" / "a.txt"), str(tmp_path / "c"),
             str(tmp_path / "c" / ".." / "c" / "b.md")]
    assert list(text_file_documents(paths)) == ["alpha", "beta"]


@pytest.mark.parametrize("vocab", [-5, 0, 10, 256])
def test_prepare_refuses_a_vocab_smaller_than_the_byte_alphabet(vocab, tmp_path, capsys):
    """--vocab-size 10 used to give a 257-token vocabulary silently; -5 an OverflowError traceback."""
    (tmp_path / "in.txt").write_text(TEXT)
    line = error_line(capsys, ["prepare-data", str(tmp_path / "in.txt"), "--out", str(tmp_path / "d"),
                               "--vocab-size", str(vocab)])
    assert f"--vocab-size={vocab}: expected >= 257" in line


def test_a_vocab_larger_than_the_corpus_supports_warns_with_the_size_it_got(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = prepare_data(["hello world\n"] * 20, tmp_path / "d", vocab_size=5000)
    got = json.loads((out / "meta.json").read_text())["vocab_size"]
    assert got < 5000
    assert any(f"vocab_size=5000 asked for, but the corpus gives only {got} tokens" in str(w.message) for w in caught)


@pytest.mark.parametrize("content", ["{}", "not json at all"])
def test_a_tokenizer_file_that_is_not_a_tokenizer_exits_2_naming_it(content, tmp_path, capsys):
    (tmp_path / "in.txt").write_text(TEXT)
    (tmp_path / "tok.json").write_text(content)
    line = error_line(capsys, ["prepare-data", str(tmp_path / "in.txt"), "--out", str(tmp_path / "d"),
                               "--tokenizer", str(tmp_path / "tok.json")])
    assert f"--tokenizer {str(tmp_path / 'tok.json')!r}: not a Hugging Face tokenizer.json" in line
    line = error_line(capsys, ["prepare-data", str(tmp_path / "in.txt"), "--out", str(tmp_path / "d"),
                               "--tokenizer", str(tmp_path)])
    assert "is a folder: expected a Hugging Face tokenizer.json file" in line


def test_end_of_text_written_inside_a_document_is_text_not_a_document_end(tmp_path):
    """A document that mentions "<|endoftext|>" (code about tokenizers) used to be cut in two there."""
    doc = f"split on {EOS} here; " * 3 + TEXT
    out = prepare_data([doc], tmp_path / "d", vocab_size=400, eval_fraction=0.5)
    meta, splits = open_data(out, 400)
    both = np.concatenate([splits["train"].tokens, splits["eval"].tokens])
    assert int((both == meta["eos_id"]).sum()) == 1  # the one ending the document
    assert not Tokenizer.from_file(str(out / "tokenizer.json")).encode_special_tokens  # users get the default
