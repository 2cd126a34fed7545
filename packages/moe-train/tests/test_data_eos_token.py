"""prepare-data with an existing tokenizer: which token ends each document (--eos-token, or the first of the
usual names the tokenizer has), and a tokenizer with none of them refused before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from moe_train.cli import main
from moe_train.data import DataError, prepare_data

DOCS = ["the quick brown fox jumps over the lazy dog\n" * 3, "pack my box with five dozen liquor jugs\n" * 2] * 20


def _tokenizer(tmp_path, specials):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer=trainer)
    path = tmp_path / f"tok-{len(specials)}.json"
    tok.save(str(path))
    return str(path), tok


def _ends_with(folder, eos_id):
    meta = json.loads((folder / "meta.json").read_text())
    tokens = np.fromfile(folder / "train.u32", dtype=np.uint32)
    assert meta["eos_id"] == eos_id and tokens[-1] == eos_id
    return int((tokens == eos_id).sum())


def test_a_llama_style_end_token_is_found(tmp_path):
    path, tok = _tokenizer(tmp_path, ["<s>", "</s>"])
    out = prepare_data(DOCS, tmp_path / "d", tokenizer_path=path, eval_fraction=0.1)
    assert _ends_with(out, tok.token_to_id("</s>")) >= 1


def test_a_tokenizer_without_an_end_token_is_refused_naming_the_option(tmp_path):
    path, tok = _tokenizer(tmp_path, ["<pad>"])
    with pytest.raises(DataError, match=r"no end-of-document token.*--eos-token.*<pad>"):
        prepare_data(DOCS, tmp_path / "d", tokenizer_path=path)
    assert not (tmp_path / "d").exists()  # refused before anything was written
    out = prepare_data(DOCS, tmp_path / "d", tokenizer_path=path, eos_token="<pad>", eval_fraction=0.1)
    assert _ends_with(out, tok.token_to_id("<pad>")) >= 1


def test_an_eos_token_the_tokenizer_lacks_is_refused(tmp_path):
    path, _ = _tokenizer(tmp_path, ["</s>"])
    with pytest.raises(DataError, match=r"--eos-token '<\|im_end\|>': not in the tokenizer's vocabulary"):
        prepare_data(DOCS, tmp_path / "d", tokenizer_path=path, eos_token="<|im_end|>")


def test_cli_eos_token_needs_a_tokenizer(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text(DOCS[0])
    assert main(["prepare-data", str(src), "--out", str(tmp_path / "d"), "--eos-token", "</s>"]) == 2
    assert "--eos-token=</s> without --tokenizer" in capsys.readouterr().err
    path, tok = _tokenizer(tmp_path, ["<pad>"])
    (tmp_path / "many.txt").write_text("\n\n".join(DOCS))
    assert main(["prepare-data", str(tmp_path / "many.txt"), "--out", str(tmp_path / "d"), "--tokenizer", path,
                 "--eos-token", "<pad>"]) == 0
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["eos_id"] == tok.token_to_id("<pad>")


def test_an_ordinary_vocabulary_token_as_eos_token_is_refused(tmp_path):
    """QA 153 (review helper 174): --eos-token naming a token the text produces made each occurrence a document's end
    (10 files of 'a b a b a a b' gave 40 documents), silently."""
    path, tok = _tokenizer(tmp_path, ["<pad>"])
    assert tok.token_to_id("the") is not None  # an ordinary, learned token
    with pytest.raises(DataError, match=r"--eos-token 'the': an ordinary token of its vocabulary \(id \d+\), which "
                                        r"the text itself tokenizes to, so each of them would end a document.*special "
                                        r"tokens: <pad>"):
        prepare_data(DOCS, tmp_path / "d", tokenizer_path=path, eos_token="the")
    assert not (tmp_path / "d").exists()


def _with(tmp_path, tok, name):
    path = tmp_path / f"{name}.json"
    tok.save(str(path))
    return str(path)


def test_an_added_token_that_is_not_special_is_refused_as_eos(tmp_path):
    """Review helper 175: an added, non-special '<eos>' is matched in the text (encode_special_tokens protects
    special ones only): 3 files holding the literal '<eos>' 30 times each gave 94 documents."""
    from tokenizers import AddedToken

    _, tok = _tokenizer(tmp_path, ["<pad>"])
    tok.add_tokens([AddedToken("<eos>", special=False)])
    path = _with(tmp_path, tok, "nonspecial")
    with pytest.raises(DataError, match=r"--eos-token '<eos>': an added token that is not special \(id \d+\)"):
        prepare_data(DOCS, tmp_path / "d", tokenizer_path=path, eos_token="<eos>")


def test_a_default_end_token_that_is_an_ordinary_word_is_refused(tmp_path):
    """Review helper 175: the default lookup took an ordinary vocabulary entry '</s>' without the check --eos-token
    got."""
    from tokenizers import models as tok_models

    words = {w: i for i, w in enumerate(["[UNK]", "the", "fox", "</s>"])}
    tok = Tokenizer(tok_models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = _with(tmp_path, tok, "wordlevel")
    with pytest.raises(DataError, match=r"--tokenizer .*: its end-of-document token '</s>' \(the first of .*\): an "
                                        r"ordinary token of its vocabulary"):
        prepare_data(DOCS, tmp_path / "d", tokenizer_path=path)


def test_the_unknown_token_and_a_beginning_of_text_token_are_refused_as_eos(tmp_path):
    """Review helper 175: --eos-token '<unk>' made every unknown character a document's end (1,624 documents from 3
    files), and a template's BOS '<s>' split each document once more."""
    from tokenizers import processors

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(DOCS, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    path = _with(tmp_path, tok, "llama_like")
    with pytest.raises(DataError, match=r"--eos-token '<unk>': the tokenizer's unknown token"):
        prepare_data(DOCS, tmp_path / "d", tokenizer_path=path, eos_token="<unk>")
    with pytest.raises(DataError, match=r"--eos-token '<s>': a token \(id \d+\) the tokenizer's template puts before "
                                        r"each text"):
        prepare_data(DOCS, tmp_path / "d", tokenizer_path=path, eos_token="<s>")
    out = prepare_data(DOCS, tmp_path / "d", tokenizer_path=path, eval_fraction=0.1)  # '</s>' by default: fine
    assert _ends_with(out, tok.token_to_id("</s>")) >= 1
