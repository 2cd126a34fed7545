"""The tokenizer of a data folder: the byte-level BPE trained here (its pre-tokenizer and vocabulary bounds), a
given tokenizer.json loaded, the end-of-document token looked up, and where a document may be cut into pieces
(`_pieces`) that tokenize, and train the BPE, as the whole document does. prepare.py runs it over the documents."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_train.data.token_file import DataError

EOS = "<|endoftext|>"
# what an existing tokenizer may call its end-of-document token, looked for in this order (GPT-2/NeoX/Qwen,
# Llama 3, Llama 2/Mistral/T5, Gemma)
EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>")

# A document is tokenized, and the BPE trained, a piece of at most this many characters at a time (`_pieces`):
# the tokenizer's work on a text costs ~120 (training) to ~180 (encoding) bytes a character while it runs, and the
# trainer buffers 256 texts at a time, so one 100 MB document cost tens of GB, and a 64K-character piece ~10 MB.
PIECE_CHARS = 1 << 16


def _post_processor_ends_with(tok: Tokenizer, eos_id: int) -> bool:
    """Whether the tokenizer's post-processor ends every encoded text with eos_id itself (T5, BART, RoBERTa:
    `$A </s>`): a second one would make every document end twice, an empty document after each."""
    with_specials = tok.encode("a").ids
    return len(with_specials) > len(tok.encode("a", add_special_tokens=False).ids) and with_specials[-1] == eos_id


def _vocab_size(tok: Tokenizer) -> int:
    """The ids the tokenizer can emit: its largest id + 1 (get_vocab_size() counts tokens, less where ids skip)."""
    return max(tok.get_vocab_size(), max(tok.get_vocab().values(), default=-1) + 1)


def _document_pieces(docs: Iterable[str], piece_chars: int | None) -> Iterator[tuple[str, bool]]:
    """(piece, whether it is its document's last) for every piece of every document; whole documents with None."""
    for doc in docs:
        if piece_chars is None:
            yield doc, True
            continue
        pieces = _pieces(doc, piece_chars)
        piece = next(pieces)
        for following in pieces:
            yield piece, False
            piece = following
        yield piece, True


# Runs of non-space characters are cut into pieces of at most this many before the byte-level
# split: BPE training is quadratic in a word's length, so one long unbroken line (minified code,
# base64) took minutes per megabyte. Ordinary words are far shorter and split as before.
MAX_WORD_CHARS = 256


# Where a document may be cut into pieces that pre-tokenize, with the pre-tokenizer `train_bpe` builds, into the
# whole document's pre-tokens: pre_tokenize(doc) == pre_tokenize(doc[:b]) + pre_tokenize(doc[b:]), so the BPE
# trainer counts the same words and the encoder (which tokenizes each pre-token on its own) gives the same ids.
# That pre-tokenizer is (1) Split(\S{256}, isolated): every maximal run of non-whitespace (Oniguruma's \S) starting
# at s is cut at s, s+256, s+512, ... up to its end; then (2) ByteLevel's GPT-2 regex on each of those splits,
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# matched left to right from each split's start (no lookbehind, no anchors; every character matched).
# Two kinds of cut b are safe:
#  - before whitespace: doc[b] in _CUT_SPACE and doc[b-1] not whitespace. (1) A run of non-whitespace never spans
#    b, so the runs, and the cuts of (1), of doc[:b] and doc[b:] are doc's. (2) In the split holding b, a match
#    starting before b never reaches b: only \s+ and the leading " ?" can take the whitespace doc[b], \s+ only
#    by a whitespace run reaching doc[b-1], " ?" only as a match's first character; and those matches read doc[b]
#    only to stop there, and stop at the string's end alike ((?!\S) holds at whitespace and at the end). So a
#    match starts at b in doc as in doc[b:], and matching from b reads only what follows b.
#  - inside a long word: b = s + 256k (k >= 1) where doc[s:b] is non-whitespace and s is the piece's start or
#    doc[s-1] is in _CUT_SPACE. Then b is a cut of (1) (doc's run starts at s and is >= 256k long), doc[:b] ends
#    with k whole blocks of it and doc[b:] starts with the rest, cut at the same places; (2) runs on each split.
# Whitespace here: Oniguruma's \s (which the tokenizer uses) is Python's str.isspace() less U+001C-U+001F, so
# "not isspace()" is never Oniguruma whitespace (tests/test_qa56.py checks every code point), and the cut
# characters _CUT_SPACE are whitespace to both. Pieces are cut between code points, never inside a UTF-8 sequence.
# A long run of whitespace (one pre-token, ending one character before the next word) has no safe cut: it stays
# whole, and so a piece can be longer than asked for.
_CUT_SPACE = " \t\n\r\f\v"
_WORD_END = re.compile(r"\S[ \t\n\r\f\v]")  # a cut between its two characters
_LONG_WORD = re.compile(rf"[ \t\n\r\f\v](\S{{{MAX_WORD_CHARS},}})")
_LONG_WORD_AT_START = re.compile(rf"\S{{{MAX_WORD_CHARS},}}")


def _last_cut(doc: str, start: int, end: int) -> int | None:
    """The last safe cut b (see above) of the piece doc[start:], start < b <= end < len(doc); None if none."""
    end = min(end, len(doc) - 1)
    best = None
    for lookback in (1 << 12, 1 << 16, None):  # the last word end is almost always near the end
        lo = start if lookback is None else max(start, end - lookback)
        for m in _WORD_END.finditer(doc, lo, end + 1):
            best = m.start() + 1
        if best is not None or lo == start:
            break
    runs = [(m.start(1), m.end(1)) for m in _LONG_WORD.finditer(doc, start, end)]
    if (m := _LONG_WORD_AT_START.match(doc, start, end)) is not None:
        runs.insert(0, m.span())
    if runs:  # runs cut at end by endpos are as long as that at least; take the last cut of the last one
        s, e = runs[-1]
        b = s + (e - s) // MAX_WORD_CHARS * MAX_WORD_CHARS
        best = b if best is None else max(best, b)
    return best


def _pieces(doc: str, max_chars: int) -> Iterator[str]:
    """doc in pieces of at most max_chars characters (longer only where no safe cut is found within them), cut at
    the last safe cut of each: their pre-tokens, one after the other, are doc's."""
    start, n = 0, len(doc)
    while n - start > max_chars:
        span = max_chars
        cut = _last_cut(doc, start, start + span)
        while cut is None and start + span < n - 1:  # none within max_chars: the first one after them
            span *= 2
            cut = _last_cut(doc, start, start + span)
        if cut is None:
            break
        yield doc[start:cut]
        start = cut
    yield doc[start:] if start else doc


# A byte-level BPE starts from the 256 byte tokens and the end-of-text token.
MIN_BPE_VOCAB = 257
# tokenizers' BPE trainer reserves 45-66 bytes for every token asked for before it reads a word, and aborts the
# process (a Rust out-of-memory backtrace, no Python error) when the system refuses: 2**31 asked for 141 GB,
# 10**11 for 4.5 TB. 2**20 (under 70 MB) is four times the largest real vocabularies (~256K).
MAX_BPE_VOCAB = 2**20


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of the BPE trained here; `_pieces` cuts documents only where it splits them anyway."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rf"\S{{{MAX_WORD_CHARS}}}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])


def _cuts_safely(tok: Tokenizer) -> bool:
    """Whether encoding `_pieces` of a document gives the whole document's ids: the tokenizer adds nothing per
    text and splits as `_pieces` assumes. That is, no normalizer (one could change or strip text at a piece's
    edge), the pre-tokenizer built here, a BPE model without dropout (each pre-token tokenized on its own), no
    post-processor, truncation or padding (they act per text), and only special added tokens (encoding passes
    them as text, `encode_special_tokens`; another added token could span a cut). The BPE trained here is; a
    given tokenizer.json is when it is one prepare-data wrote. Others are encoded a whole document at a time."""
    config = json.loads(tok.to_str())
    ours = json.loads(_pre_tokenizer().__getstate__())
    return (config.get("normalizer") is None and config.get("pre_tokenizer") == ours
            and config.get("post_processor") is None and config.get("truncation") is None
            and config.get("padding") is None and config["model"].get("type") == "BPE"
            and config["model"].get("dropout") is None
            and all(t.get("special") for t in config.get("added_tokens", [])))


def train_bpe(docs: Iterable[str], vocab_size: int, piece_chars: int | None = PIECE_CHARS) -> Tokenizer:
    """A byte-level BPE of vocab_size tokens trained on docs, read a piece of at most about piece_chars
    characters at a time (None: a whole document at a time; the trainer counts the same words either way)."""
    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"vocab_size={vocab_size}: expected >= {MIN_BPE_VOCAB} (a byte-level BPE holds the 256 byte "
                        f"tokens and {EOS})")
    if vocab_size > MAX_BPE_VOCAB:
        raise DataError(f"vocab_size={vocab_size}: expected <= {MAX_BPE_VOCAB} (2**20; the BPE trainer reserves "
                        "memory for every token asked for, and real vocabularies are far smaller)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = docs if piece_chars is None else (piece for doc in docs for piece in _pieces(doc, piece_chars))
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str) -> Tokenizer:
    if not Path(path).is_file():
        raise FileNotFoundError(f"--tokenizer {path!r} " + ("is a folder" if Path(path).is_dir() else "does not exist")
                                + ": expected a Hugging Face tokenizer.json file")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for JSON it cannot read
        raise DataError(f"--tokenizer {path!r}: not a Hugging Face tokenizer.json ({e})") from None


def _eos_id(tok: Tokenizer, tokenizer_path: str | None, eos_token: str | None) -> int:
    """The id that ends each document: eos_token's, else the first of EOS_NAMES the tokenizer has. A tokenizer
    with none of them is refused: any other id would be a real token of the text, read as a document's end. So is
    a token the tokenizer itself produces from text (_refuse_a_token_the_text_produces)."""
    if eos_token is not None:
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"--eos-token {eos_token!r}: not in the tokenizer's vocabulary; expected one of its tokens "
                            f"(its special tokens: {_special_tokens(tok)})")
        _refuse_a_token_the_text_produces(tok, eos_token, eos_id, f"--eos-token {eos_token!r}")
        return eos_id
    for name in EOS_NAMES:
        eos_id = tok.token_to_id(name)
        if eos_id is not None:
            _refuse_a_token_the_text_produces(tok, name, eos_id, f"--tokenizer {tokenizer_path!r}: its end-of-document "
                                              f"token {name!r} (the first of {', '.join(EOS_NAMES)} it has)")
            return eos_id
    raise DataError(f"--tokenizer {tokenizer_path!r}: has no end-of-document token (looked for {', '.join(EOS_NAMES)}); "
                    f"name the one to use with --eos-token (its special tokens: {_special_tokens(tok)})")


def _refuse_a_token_the_text_produces(tok: Tokenizer, name: str, eos_id: int, what: str) -> None:
    """Every place the tokenizer puts the end-of-document id would end a document there (review helpers 174, 175: 10
    files gave 40 documents, 3 gave 94 or 1,624). Refused: an ordinary vocabulary token or an added one that is not
    special (prepare-data reads special tokens in the text as text, `encode_special_tokens`, and only those), the
    unknown token (every character the vocabulary lacks), and one the tokenizer's template puts before the text (a
    beginning-of-text token; one it puts after, `$A </s>`, is the end it should be, and is not doubled)."""
    special = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    if not special.get(name, False):
        kind = "an added token that is not special" if name in special else "an ordinary token of its vocabulary"
        why = f"{kind} (id {eos_id}), which the text itself tokenizes to"
    elif getattr(tok.model, "unk_token", None) == name:
        why = f"the tokenizer's unknown token (id {eos_id}), which every character its vocabulary lacks becomes"
    elif eos_id in tok.encode("a").ids[:-1]:
        why = f"a token (id {eos_id}) the tokenizer's template puts before each text, as a beginning-of-text token"
    else:
        return
    raise DataError(f"{what}: {why}, so each of them would end a document; expected a special token only the end "
                    f"of a document produces (its special tokens: {_special_tokens(tok)})")


def _special_tokens(tok: Tokenizer) -> str:
    names = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    return ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "") if names else "none"
