"""Tokenize text into a data folder: train a byte-level BPE, or use a given tokenizer.json."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_train.data.token_file import FORMAT, DataError, write_meta, write_split

EOS = "<|endoftext|>"
EVAL_BLOCK_TOKENS = 2048


def split_blocks(stream: np.ndarray, eval_fraction: float, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Every round(1/eval_fraction)-th block of `block` tokens is held out, so eval samples the whole corpus."""
    every = max(2, round(1 / eval_fraction))
    if stream.size < 2 * every * block:  # a small corpus: smaller blocks, still spread over all of it
        block = max(1, stream.size // (2 * every))
    n_blocks = max(1, -(-stream.size // block))
    is_eval = np.zeros(n_blocks, dtype=bool)
    is_eval[every // 2 :: every] = True
    if not is_eval.any():
        is_eval[-1] = True
    if is_eval.all():
        raise ValueError(f"{stream.size} tokens are too few to hold out an eval split in blocks of {block}")
    mask = np.repeat(is_eval, block)[: stream.size]
    return stream[~mask], stream[mask]


# Runs of non-space characters are cut into pieces of at most this many before the byte-level
# split: BPE training is quadratic in a word's length, so one long unbroken line (minified code,
# base64) took minutes per megabyte. Ordinary words are far shorter and split as before.
MAX_WORD_CHARS = 256


def train_bpe(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rf"\S{{{MAX_WORD_CHARS}}}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def _build(docs: list[str], tmp: Path, vocab_size: int, tokenizer_path: str | None, eval_fraction: float,
           source: str) -> None:
    if tokenizer_path:
        if not Path(tokenizer_path).is_file():
            raise FileNotFoundError(f"tokenizer {tokenizer_path!r} does not exist")
        tok = Tokenizer.from_file(tokenizer_path)
    else:
        tok = train_bpe(docs, vocab_size)
    eos_id = tok.token_to_id(EOS)
    if eos_id is None:
        eos_id = tok.get_vocab_size() - 1 if tokenizer_path else 0
    tok.save(str(tmp / "tokenizer.json"))
    encoded = [e.ids + [eos_id] for e in tok.encode_batch(docs)]
    stream = np.fromiter((t for doc in encoded for t in doc), dtype=np.uint32)
    train, held_out = split_blocks(stream, eval_fraction, EVAL_BLOCK_TOKENS)
    n_train, d_train = write_split(tmp, "train", train, eos_id)
    n_eval, d_eval = write_split(tmp, "eval", held_out, eos_id)
    digest = hashlib.sha256("\x00".join(docs).encode()).hexdigest()[:16]
    write_meta(tmp, {
        "format": FORMAT, "vocab_size": tok.get_vocab_size(), "eos_id": eos_id, "tokenizer": "tokenizer.json",
        "source": source, "corpus_sha256_16": digest,
        "eval_block_tokens": EVAL_BLOCK_TOKENS,
        "splits": {"train": {"num_tokens": n_train, "num_docs": d_train},
                   "eval": {"num_tokens": n_eval, "num_docs": d_eval}},
    })


def prepare_data(
    docs: list[str], out: str | Path, vocab_size: int = 4096, tokenizer_path: str | None = None,
    eval_fraction: float = 0.02, source: str = "",
) -> Path:
    """Write a data folder at `out` (built in a temporary folder, then renamed). Returns its path."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and (out / "meta.json").is_file()):
        raise DataError(f"--out {str(out)!r} exists and is not a data folder (no meta.json): prepare-data replaces "
                        "its output whole, so it only writes a new folder or over an earlier data folder")
    if not docs:
        raise DataError("no documents to tokenize (expected .txt, .md or .py files with text)")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _build(docs, tmp, vocab_size, tokenizer_path, eval_fraction, source)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
