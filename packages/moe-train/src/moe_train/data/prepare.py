"""Tokenize text into a data folder: train a byte-level BPE, or use a given tokenizer.json."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_train.data.token_file import FORMAT, write_meta, write_split

EOS = "<|endoftext|>"


def train_bpe(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def prepare_data(
    docs: list[str], out: str | Path, vocab_size: int = 4096, tokenizer_path: str | None = None,
    eval_fraction: float = 0.02, source: str = "",
) -> Path:
    """Write a data folder at `out` (built in a temporary folder, then renamed). Returns its path."""
    out = Path(out)
    if not docs:
        raise ValueError("no documents to tokenize")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
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
    encoded = [e.ids for e in tok.encode_batch(docs)]
    n_eval = max(1, int(round(len(encoded) * eval_fraction)))
    # every k-th document goes to eval so both splits sample the whole corpus
    stride = max(1, len(encoded) // n_eval)
    eval_idx = set(range(stride // 2, len(encoded), stride)) if len(encoded) > 1 else set()
    train_docs = [d for i, d in enumerate(encoded) if i not in eval_idx]
    eval_docs = [d for i, d in enumerate(encoded) if i in eval_idx] or train_docs[-1:]
    n_train = write_split(tmp, "train", train_docs, eos_id)
    n_eval_tok = write_split(tmp, "eval", eval_docs, eos_id)
    digest = hashlib.sha256("\x00".join(docs).encode()).hexdigest()[:16]
    write_meta(tmp, {
        "format": FORMAT, "vocab_size": tok.get_vocab_size(), "eos_id": eos_id, "tokenizer": "tokenizer.json",
        "source": source, "corpus_sha256_16": digest,
        "splits": {"train": {"num_tokens": n_train, "num_docs": len(train_docs)},
                   "eval": {"num_tokens": n_eval_tok, "num_docs": len(eval_docs)}},
    })
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
