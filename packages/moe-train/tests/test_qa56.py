"""QA 56: prepare-data tokenizes a long document, and trains its BPE on it, a piece at a time, cut only where the
pre-tokenizer splits anyway: the tokens and the BPE are those of whole documents, and memory is bounded by a piece,
not by the document (one 9.6 MB file peaked at 2.4 GB: ~180 bytes a character encoding, ~120 training)."""

import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors

from moe_train.data import prepare_data, train_bpe
from moe_train.data import prepare as prep
from moe_train.data import tokenizer as tokenizer_mod
from moe_train.data.prepare import EOS, _encode_to_file
from moe_train.data.tokenizer import MAX_WORD_CHARS, _cuts_safely, _pieces, _pre_tokenizer

FILES = ["eval.docs.u64", "eval.u32", "meta.json", "tokenizer.json", "train.docs.u64", "train.u32"]
PIECE_SIZES = [1, 2, 5, 17, 64, 255, 256, 257, 700]


def random_document(rng: random.Random, n: int) -> str:
    """About n characters of adversarial text: words, numbers, contractions, punctuation, unicode (multi-byte,
    combining, wide), every kind of whitespace (ASCII, Unicode spaces, U+001C-U+001F, which Python calls
    whitespace and the tokenizer's regex does not) in long runs, and words around multiples of MAX_WORD_CHARS."""
    parts, size = [], 0
    while size < n:
        r = rng.random()
        if r < 0.35:
            s = rng.choice(["the", "alpha", "x", "δέλτα", "日本語", "e\u0301t\u00e9", "😀🚀", "naïve", "Ωμέγα", "한국어",
                            "it's", "we're", "'ll", "'d", EOS, "<|", "123", "4.5e6", "_", "$x", "def", "return"])
        elif r < 0.55:
            s = rng.choice([" ", " ", "\n", "\t", "\r\n", "  ", "\u3000", "\u00a0", "\x1c", "\x1f", "\x0b", "\x0c",
                            "\u2028", "\x85", " \n", "\n\n"])
        elif r < 0.70:
            s = rng.choice([".", ",", "!?", "...", "(", ")", "--", "'", "'s", "#", "=>", "「", "」", "\\"])
        elif r < 0.80:
            s = str(rng.randint(0, 10 ** rng.randint(1, 15)))
        elif r < 0.88:  # long whitespace runs, also around the piece sizes
            s = rng.choice([" ", "\n", "\t", " \n", "\u3000", "\x1c "]) * rng.choice([rng.randint(2, 40), 256, 700])
        elif r < 0.97:  # long words, around MAX_WORD_CHARS's multiples and the piece sizes
            k = rng.choice([MAX_WORD_CHARS - 1, MAX_WORD_CHARS, MAX_WORD_CHARS + 1, 2 * MAX_WORD_CHARS,
                            3 * MAX_WORD_CHARS + 5, 699, 700, 701, rng.randint(30, 1500)])
            s = "".join(rng.choices(rng.choice(["abcxyz", "0123456789", "日本😀é", "a.b-c", "ab\x1ccd", "a'sb"]), k=k))
        else:
            s = rng.choice(["\x1c", "\x1d", "\x1e", "\x1f"]).join(["w" * rng.randint(100, 300)] * 2)
        parts.append(s)
        size += len(s)
    return "".join(parts)


def edge_documents(size: int) -> list[str]:
    """Hand-made adversarial documents for a piece size."""
    return [
        "a" * (size + 1),  # just over one piece, one word
        "ab " * (size // 3 + 1) + "c",  # just over one piece, many words
        " " * (3 * size + 1) + "x",  # a whitespace run with no cut in it
        "x" * (3 * MAX_WORD_CHARS + 5) + " y",  # long-word cuts
        "日" * size + " " + "😀" * size + "\n" + "é" * (size + 3),  # multi-byte characters at the edges
        "w" * 300 + "\x1c" + "v" * 300 + " z",  # one onig word of 601 characters, two Python words
        ("it's " * size)[: size + 2] + "\n\n   \n" + "q",
        "\n" * size + "a" + " " * size,
    ]


def pre_tokens(texts: list[str]) -> list[str]:
    pre = _pre_tokenizer()
    return [s for t in texts for s, _ in pre.pre_tokenize_str(t)]


def test_what_python_calls_non_whitespace_is_never_whitespace_to_the_tokenizers_regex():
    """The cuts rest on this: Oniguruma's \\s (the tokenizer's) is within str.isspace(), every code point checked;
    the characters cut before are whitespace to both."""
    chars = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF)
    kept = "".join(s for s, _ in pre_tokenizers.Split(Regex(r"\s"), behavior="removed").pre_tokenize_str(chars))
    onig_whitespace = set(chars) - set(kept)
    assert onig_whitespace <= {c for c in chars if c.isspace()}
    assert set(tokenizer_mod._CUT_SPACE) <= onig_whitespace
    assert {c for c in chars if c.isspace()} - onig_whitespace == set("\x1c\x1d\x1e\x1f")  # what differs
    assert re.sub(r"\s", "", chars) == "".join(c for c in chars if not c.isspace())  # the cuts' \S is not isspace()


@pytest.mark.parametrize("size", PIECE_SIZES)
def test_pieces_pre_tokenize_exactly_as_the_whole_document(size):
    rng = random.Random(size)
    docs = edge_documents(size) + [random_document(rng, rng.randint(1, 4000)) for _ in range(60)]
    cut_docs = 0
    for doc in docs:
        pieces = list(_pieces(doc, size))
        assert "".join(pieces) == doc and all(pieces)
        assert pre_tokens(pieces) == pre_tokens([doc]), (size, doc[:200])
        cut_docs += len(pieces) > 1
    assert cut_docs >= len(docs) * 3 // 4  # the boundaries were exercised


def test_pieces_are_as_small_as_asked_where_the_text_allows():
    rng = random.Random(1)
    doc = " ".join("".join(rng.choices("abcdefgh", k=rng.randint(1, 9))) for _ in range(20_000))
    assert max(map(len, _pieces(doc, 1000))) <= 1000
    word = "x" * 10_000  # one word: cut every MAX_WORD_CHARS
    assert [len(p) for p in _pieces(word, 1000)] == [768] * 12 + [784]
    assert list(_pieces(doc, len(doc))) == [doc]


def corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = [random_document(rng, rng.choice([5, 50, 400, 3000, 9000])) for _ in range(30)]
    return docs + edge_documents(300) + [" \n\t", ""]  # whitespace-only and empty ones are left out


@pytest.mark.parametrize("piece_chars", [3, 64, 300])
def test_prepare_data_in_pieces_writes_what_whole_documents_give(piece_chars, tmp_path, monkeypatch):
    """The BPE trained on pieces is the one trained on whole documents (its trainer counts the same words: the
    pieces' pre-tokens are the documents'), and the data folder is the same byte for byte, trained or given."""
    docs = corpus(piece_chars)
    whole = prepare_data(docs, tmp_path / "whole", vocab_size=400, piece_chars=None)
    calls = []
    real_pieces = tokenizer_mod._pieces
    monkeypatch.setattr(tokenizer_mod, "_pieces", lambda doc, n: calls.append(doc) or real_pieces(doc, n))
    monkeypatch.setattr(prep, "ENCODE_BATCH_CHARS", 1_000)  # a document's pieces in several batches
    cut = prepare_data(docs, tmp_path / "cut", vocab_size=400, piece_chars=piece_chars)
    given = prepare_data(docs, tmp_path / "given", tokenizer_path=str(whole / "tokenizer.json"),
                         piece_chars=piece_chars)
    kept = [d for d in docs if d.strip()]
    assert len(calls) == 3 * len(kept)  # training, encoding, encoding with the given tokenizer: all in pieces
    for name in FILES:
        assert (cut / name).read_bytes() == (whole / name).read_bytes(), name
        assert (given / name).read_bytes() == (whole / name).read_bytes(), name


def test_each_document_ends_with_one_end_of_text_token_not_one_per_piece(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "ENCODE_BATCH_CHARS", 200)
    rng = random.Random(3)
    docs = [random_document(rng, rng.randint(1, 3000)).replace(EOS, "") for _ in range(40)]
    tok = train_bpe(docs, 400)
    tok.encode_special_tokens = True
    eos = tok.token_to_id(EOS)
    _encode_to_file(docs, tok, eos, tmp_path / "cut.u32", piece_chars=7)
    ids = np.fromfile(tmp_path / "cut.u32", dtype="<u4")
    expected = np.concatenate([np.append(np.asarray(e.ids, np.uint32), eos) for e in tok.encode_batch_fast(docs)])
    assert np.array_equal(ids, expected)
    assert np.count_nonzero(ids == eos) == len(docs)


def changed(how: str, tok: Tokenizer) -> Tokenizer:
    if how == "prefix space":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif how == "strip":
        tok.normalizer = normalizers.Strip()
    elif how == "begin token":  # its own: the end token put before each text is refused as the end (0.27.27)
        tok.add_special_tokens(["<bos>"])
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                           special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    elif how == "added token":
        tok.add_tokens(["a b"])  # spans a cut before the space
    return tok


@pytest.mark.filterwarnings("ignore:vocab_size=300 asked for")  # a tiny corpus
@pytest.mark.parametrize("how", ["prefix space", "strip", "begin token", "added token"])
def test_a_tokenizer_that_splits_otherwise_is_given_whole_documents(how, tmp_path):
    """Cutting is proved only for the pre-tokenizer built here; a tokenizer.json that normalizes, splits, adds or
    matches text otherwise would give other tokens for pieces, so it gets whole documents."""
    docs = [("a b  c\n" * 200) + "end"] * 3
    trained = prepare_data(docs, tmp_path / "trained", vocab_size=300, piece_chars=5)
    assert _cuts_safely(Tokenizer.from_file(str(trained / "tokenizer.json")))  # what prepare-data wrote
    tok = changed(how, Tokenizer.from_file(str(trained / "tokenizer.json")))
    assert not _cuts_safely(tok)
    tok.encode_special_tokens = True
    assert [i for p in _pieces(docs[0], 5) for i in tok.encode(p).ids] != tok.encode(docs[0]).ids  # why
    tok.save(str(tmp_path / "tok.json"))
    given = prepare_data(docs, tmp_path / "given", tokenizer_path=str(tmp_path / "tok.json"), piece_chars=5)
    whole = prepare_data(docs, tmp_path / "whole", tokenizer_path=str(tmp_path / "tok.json"), piece_chars=None)
    for name in FILES:
        assert (given / name).read_bytes() == (whole / name).read_bytes(), name


# The child's own high-water mark (VmHWM), not getrusage's maxrss: that one keeps the parent's, across exec.
PEAK_RSS = """
import json, re, sys
import moe_train.data  # numpy, tokenizers and torch: loaded before the baseline
from moe_train.cli import main
def status(key): return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
base = status("VmRSS")
assert main(["prepare-data", *sys.argv[1:]]) == 0
print(json.dumps({"base": base, "peak": status("VmHWM")}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_one_large_document_is_prepared_in_memory_bounded_by_a_piece(tmp_path):
    """A single 3.8M-character document, BPE trained on it and encoded: the process grows by the document's text
    (UCS-4 here: 15 MB) and a few pieces' work (~100 MB in all). Whole, it grew by ~180 bytes a character (680 MB)
    while encoding and ~120 while training."""
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 9))) for _ in range(2000)]
    words += ["δέλτα", "日本語", "😀", "1984", "3.14", "it's", "(x)", "\n", "\n\n", " " * 40, "y" * 600]
    text = " ".join(rng.choices(words, k=600_000))
    (tmp_path / "corpus.txt").write_text(text)
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, str(tmp_path / "corpus.txt"), "--out",
                           str(tmp_path / "d"), "--vocab-size", "1000"], capture_output=True, text=True,
                          env={**os.environ, "RAYON_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = rss["peak"] - rss["base"]
    assert growth < 40 * len(text), f"peak RSS grew {growth / 2**20:.0f} MB on {len(text) / 1e6:.1f}M characters"
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert sum(s["num_docs"] for s in meta["splits"].values()) in (1, 2)  # one document (its split end counted)
