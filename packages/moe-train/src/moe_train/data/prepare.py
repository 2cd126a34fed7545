"""Tokenize text into a data folder: train a byte-level BPE, or use a given tokenizer.json (tokenizer.py holds both).

It streams: documents are read and tokenized a batch at a time into a token-stream file, which is then split
into train and eval a chunk at a time, so memory does not grow with the corpus (its BPE word counts aside). A long
document is tokenized, and the BPE trained on it, a piece at a time (`tokenizer._pieces`), cut only where the
pre-tokenizer splits anyway, so the tokens are those of the whole document and memory does not grow with a document
either (beyond its text)."""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np

from tokenizers import Tokenizer

from moe_train.data.token_file import (FORMAT, DataError, SplitWriter, fsync_path, naming_the_file, write_array,
                                       write_meta)
from moe_train.data.tokenizer import (EOS, PIECE_CHARS, _cuts_safely, _document_pieces, _eos_id,
                                      _post_processor_ends_with, _vocab_size, load_tokenizer, train_bpe)
# importable from here, where they were before the tokenizer's code moved to tokenizer.py (trainer.data_setup, tests)
from moe_train.data.tokenizer import EOS_NAMES, MAX_BPE_VOCAB, MAX_WORD_CHARS, MIN_BPE_VOCAB  # noqa: F401

EVAL_BLOCK_TOKENS = 2048


# Documents are tokenized a batch of this many characters at a time (a longer document makes its batch as long).
# The tokenizer's Encoding objects cost ~80 bytes a token and its work on a document ~150 bytes a character while it
# runs, so with whole words for tokens prepare-data grows by ~30 MB (2 threads), whatever the corpus's size.
ENCODE_BATCH_CHARS = 1 << 19
# The token stream is split into train and eval this many tokens (2 MB) at a time.
SPLIT_CHUNK_TOKENS = 1 << 19


def eval_blocks(num_tokens: int, eval_fraction: float, block: int) -> tuple[int, np.ndarray]:
    """Blocks of `block` tokens, eval_fraction of them held out and spread evenly, so eval samples the whole corpus:
    with eval_fraction = p/q (a fraction of denominator <= 10^6), block i is held out when floor((i + 1 + c)·p/q)
    passes an integer, c = ceil(q / 2p) - 1, so 1/n holds out every n-th block from block n//2 on, and 0.3 three
    in ten. Returns the block size (a small corpus gets smaller ones, still spread over all of it: at least two
    blocks of each split where the corpus has the tokens) and, per block, whether it is held out."""
    p, q = _held_out_share(eval_fraction)
    every = max(2, -(-q // min(p, q - p)))  # blocks per held-out (or kept, above 1/2) block, rounded up
    if num_tokens < 2 * every * block:
        block = max(1, num_tokens // (2 * every))
    n_blocks = max(1, -(-num_tokens // block))
    c = -(-q // (2 * p)) - 1
    i = np.arange(n_blocks, dtype=np.int64)
    is_eval = (i + 1 + c) * p // q > (i + c) * p // q
    if not is_eval.any():
        is_eval[-1] = True
    if is_eval.all():
        count = f"{num_tokens} token{'' if num_tokens == 1 else 's'}"
        raise DataError(f"the corpus is {count} (documents and their end-of-text tokens), too few to "
                        f"hold out an eval split ({eval_fraction:g} of the blocks of tokens); give prepare-data "
                        f"more text")
    return block, is_eval


def _held_out_share(eval_fraction: float) -> tuple[int, int]:
    """eval_fraction as p/q, q <= 10^6, 0 < p < q; refused where it rounds to none of the blocks or to all of them
    (below 5e-7 or that close to 1: eval_blocks would divide by zero)."""
    # float(): Fraction() refuses numpy's float32 ("argument should be a string or a Rational instance")
    share = Fraction(float(eval_fraction)).limit_denominator(10**6)
    if not 0 < share < 1:
        raise DataError(f"eval_fraction={eval_fraction!r}: expected between 1e-06 and 1 - 1e-06, the share of blocks "
                        f"held out for eval (counted in millionths; this one rounds to {share})")
    return share.numerator, share.denominator


def _split_stream_file(stream: Path, num_tokens: int, folder: Path, eval_fraction: float,
                       eos_id: int) -> tuple[int, dict[str, dict[str, int]]]:
    """The uint32 file `stream` split by `eval_blocks`, a chunk at a time, into the train and eval files of `folder`.
    Returns the block size used and each split's tokens, documents, largest token id and digest, as meta.json
    records them."""
    block, is_eval = eval_blocks(num_tokens, eval_fraction, EVAL_BLOCK_TOKENS)
    step = block * max(1, SPLIT_CHUNK_TOKENS // block)  # whole blocks per chunk
    with (open(stream, "rb") as f, SplitWriter(folder, "train", eos_id) as train,
          SplitWriter(folder, "eval", eos_id) as held_out):
        for start in range(0, num_tokens, step):
            chunk = np.fromfile(f, dtype="<u4", count=min(step, num_tokens - start))
            first = start // block
            mask = np.repeat(is_eval[first : first + -(-chunk.size // block)], block)[: chunk.size]
            train.write(chunk[~mask])
            held_out.write(chunk[mask])
        counts = {name: (*w.finish(), w.max_token_id, w.digest) for name, w in (("train", train), ("eval", held_out))}
    return block, {name: {"num_tokens": t, "num_docs": d, "max_token_id": top, "digest": digest}
                   for name, (t, d, top, digest) in counts.items()}


class _DocumentPass:
    """One pass over the documents that leaves out empty and whitespace-only ones (they would be an end-of-text
    token alone), counting what it saw and hashing what it kept: sha256 of "\\x00".join(kept documents)."""

    def __init__(self, docs: Iterable[str]) -> None:
        self.docs, self.given, self.kept, self.sha256 = docs, 0, 0, hashlib.sha256()

    def __iter__(self) -> Iterator[str]:
        for doc in self.docs:
            self.given += 1
            if doc and not doc.isspace():  # doc.strip(), without copying a large document
                if self.kept:
                    self.sha256.update(b"\x00")
                for i in range(0, len(doc), PIECE_CHARS):  # the UTF-8 of the whole, a piece at a time
                    self.sha256.update(doc[i : i + PIECE_CHARS].encode())
                self.kept += 1
                yield doc

    def require_documents(self) -> None:
        if not self.kept:
            raise DataError(f"no documents to tokenize: {self.given} given, " + (
                "all empty or whitespace" if self.given else "expected .txt, .md or .py files with text"))


def _encode_to_file(docs: Iterable[str], tok: Tokenizer, eos_id: int, path: Path,
                    piece_chars: int | None = None) -> int:
    """Tokenize `docs` a batch at a time into the uint32 file `path`, each document followed by eos_id (once, after
    its last piece; by the tokenizer's post-processor where that already ends every text with it). piece_chars: cut
    documents into `_pieces` of about that many characters (only for a tokenizer `_cuts_safely`), None: whole.
    Returns the number of tokens written."""
    none = np.zeros(0, dtype=np.uint32)
    eos = none if _post_processor_ends_with(tok, eos_id) else np.array([eos_id], dtype=np.uint32)
    written = 0
    with naming_the_file(path), open(path, "wb") as f:  # the close flushes the last bytes
        for batch in _batches(_document_pieces(docs, piece_chars), ENCODE_BATCH_CHARS):
            encodings = tok.encode_batch_fast([text for text, _ in batch])
            ids = np.concatenate([a for e, (_, last) in zip(encodings, batch)
                                  for a in (np.asarray(e.ids, np.uint32), eos if last else none)])
            write_array(f, ids.astype("<u4", copy=False))
            written += ids.size
    return written


def _batches(items: Iterable[tuple[str, bool]], max_chars: int) -> Iterator[list[tuple[str, bool]]]:
    batch, chars = [], 0
    for item in items:
        batch.append(item)
        chars += len(item[0])
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _build(docs: Iterable[str], tmp: Path, vocab_size: int, tokenizer_path: str | None, eval_fraction: float,
           source: str, eos_token: str | None = None, piece_chars: int | None = PIECE_CHARS) -> None:
    if tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
    else:
        training = _DocumentPass(docs)
        tok = train_bpe(training, vocab_size, piece_chars)
        training.require_documents()
        if tok.get_vocab_size() < vocab_size:
            got = tok.get_vocab_size()
            warnings.warn(f"vocab_size={vocab_size} asked for, but the corpus gives only {got} tokens (no more pairs "
                          f"to merge); meta.json records vocab_size={got}", stacklevel=3)
    eos_id = _eos_id(tok, tokenizer_path, eos_token)
    tok.save(str(tmp / "tokenizer.json"))
    fsync_path(tmp / "tokenizer.json")  # as the token files and meta.json are: a power loss leaves no empty one
    # A document's text "<|endoftext|>" (code about tokenizers, say) is text, not the end of the document. Set
    # after saving: the tokenizer.json users load keeps the library's default.
    tok.encode_special_tokens = True
    # A tokenizer.json saved with truncation or padding (for a classifier, say) would cut every document to its
    # max_length, or fill it with pad ids: a document is tokenized whole. After saving, as above.
    tok.no_truncation()
    tok.no_padding()
    # The split depends on the corpus's token count: the whole stream goes to a file first, then is split.
    encoding, stream = _DocumentPass(docs), tmp / "stream.u32"
    if piece_chars is not None and not _cuts_safely(tok):
        piece_chars = None  # another tokenizer's splitting is not known here: whole documents
    num_tokens = _encode_to_file(encoding, tok, eos_id, stream, piece_chars)
    encoding.require_documents()
    block, splits = _split_stream_file(stream, num_tokens, tmp, eval_fraction, eos_id)
    stream.unlink()
    # the ids the tokenizer emitted count too: a post-processor's special token need not be in its vocabulary
    vocab_size = max(_vocab_size(tok), 1 + max(split["max_token_id"] for split in splits.values()))
    write_meta(tmp, {
        "format": FORMAT, "vocab_size": vocab_size, "eos_id": eos_id, "tokenizer": "tokenizer.json",
        "source": source, "corpus_sha256_16": encoding.sha256.hexdigest()[:16],
        "eval_block_tokens": block, "splits": splits,  # the blocks used: a small corpus gets smaller ones
    })


# What prepare-data writes into a data folder; anything else there is someone's and stops a replace.
DATA_FILES = frozenset({"meta.json", "tokenizer.json", "train.u32", "eval.u32", "train.docs.u64", "eval.docs.u64"})


def _check_replaceable(out: Path) -> None:
    """`out` may be written: it is new, or an earlier data folder holding nothing but what prepare-data writes."""
    if not out.exists():
        return
    if not (out.is_dir() and (out / "meta.json").is_file()):
        raise DataError(f"--out {str(out)!r} exists and is not a data folder (no meta.json): prepare-data replaces "
                        "its output whole, so it only writes a new folder or over an earlier data folder")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in DATA_FILES and not p.name.endswith(".tmp"))
    if foreign:
        raise DataError(f"--out {str(out)!r} is a data folder that also holds {foreign[:5]}, which prepare-data did "
                        "not write (inputs kept in the output folder?); it replaces its output whole, so move them "
                        "out or choose another --out")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process, or not a pid we can ask about: leave its folder alone
    return True


def _remove_leftovers(out: Path) -> None:
    """Folders of earlier runs on `out` that were killed (their process is gone, or it is this one, interrupted
    before): never data, only clutter."""
    for marker in (".tmp-", ".old-"):
        for p in out.parent.glob(f"{out.name}{marker}*"):
            pid = p.name[len(out.name) + len(marker):]
            if pid.isdigit() and p.is_dir() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
                shutil.rmtree(p, ignore_errors=True)


def _install(tmp: Path, out: Path) -> None:
    """Put the finished folder `tmp` at `out`: the old folder is renamed aside, the new one renamed in, and only
    then is the old one deleted. `out` is at every moment the old folder whole, absent, or the new one whole;
    a run killed while deleting never leaves a half-deleted folder that still has its meta.json. Its files are on
    disk already; the folder's entries are put there before the rename, and the rename after it."""
    fsync_path(tmp)
    old = out.with_name(out.name + f".old-{os.getpid()}")
    for _ in range(10):  # another prepare on the same folder may put its own in between: move that aside too
        try:
            os.replace(out, old)
        except FileNotFoundError:
            pass
        try:
            os.replace(tmp, out)
            break
        except OSError:
            if not out.exists():
                raise
            shutil.rmtree(old, ignore_errors=True)
    else:
        raise DataError(f"--out {str(out)!r}: other processes keep writing it; could not put {str(tmp)!r} in place")
    shutil.rmtree(old, ignore_errors=True)
    try:  # the new folder is in place: a failure here is reported, not raised
        fsync_path(out.parent)
    except OSError as e:
        warnings.warn(f"--out {str(out)!r} is in place, but its parent folder could not be put on disk ({e}): a "
                      "power loss now could leave the old folder there", stacklevel=3)


def prepare_data(
    docs: Iterable[str], out: str | Path, vocab_size: int = 4096, tokenizer_path: str | None = None,
    eval_fraction: float = 0.02, source: str = "", eos_token: str | None = None,
    piece_chars: int | None = PIECE_CHARS,
) -> Path:
    """Write a data folder at `out` (built in a temporary folder, then renamed). Returns its path.
    `docs` is read once per pass, never held whole: twice when a BPE is trained here (a list, or `Documents` such
    as `text_file_documents(...)`, which reads its files afresh each pass), once with `tokenizer_path` (a
    generator will do). Empty and whitespace-only documents are left out (they would be an end-of-text token
    alone). eos_token: the token that ends each document (default: the first of EOS_NAMES the tokenizer has; one
    with none of them is refused). piece_chars: documents are tokenized (and the BPE trained) in pieces of about
    this many characters, cut where the pre-tokenizer splits anyway; None: whole documents. The tokens are the
    same; pieces are used only with the BPE trained here or a tokenizer.json prepare-data wrote."""
    if piece_chars is not None and piece_chars < 1:
        raise ValueError(f"piece_chars={piece_chars!r}: expected a positive number of characters, or None")
    if eos_token is not None and tokenizer_path is None:
        raise DataError(f"eos_token={eos_token!r} without a tokenizer: the BPE trained here ends documents with {EOS!r}")
    if not 0 < eval_fraction < 1:  # eval_blocks holds out every round(1 / eval_fraction)-th block
        raise DataError(f"eval_fraction={eval_fraction!r}: expected in (0, 1), the share of tokens held out for eval")
    _held_out_share(eval_fraction)  # one that rounds to no block: refused before tokenizing, not at the split
    out = Path(os.path.abspath(out)) if Path(out).name in ("", "..") else Path(out)  # "--out ." has a name to rename
    if tokenizer_path is None and iter(docs) is docs:
        raise TypeError(f"docs is a one-shot iterator ({type(docs).__name__}), and training a BPE reads the documents "
                        "twice: pass a list, moe_train.data.Documents, or a tokenizer_path")
    _check_replaceable(out)
    _remove_leftovers(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _build(docs, tmp, vocab_size, tokenizer_path, eval_fraction, source, eos_token, piece_chars)
        _check_replaceable(out)  # nothing of someone else's arrived there while we worked
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind: a file found bad late included
        raise
    return out
