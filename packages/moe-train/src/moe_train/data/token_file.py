"""Tokenized data on disk: flat uint32 token files (numpy memmap) with document boundaries.

A data folder holds:
  meta.json            {"format": "moe-train-tokens/1", "vocab_size", "eos_id", "splits": {...}, "tokenizer"};
                       each split {"num_tokens", "num_docs", "max_token_id"} (max_token_id: its largest id, -1 when
                       empty; written since moe-train 0.16.0, so a folder is opened without reading every token) and
                       "digest" ("blake2b-" + the hex of `b2sum -l 256` of its .u32 file, so a resume can tell the
                       tokens its checkpoint trained on from others: split_identity; absent from older folders)
  train.u32, eval.u32  raw little-endian uint32 tokens, documents back to back, each ended by eos_id
                       (no header: np.memmap-compatible like OLMo-core's token .npy files)
  train.docs.u64, ...  document end offsets (exclusive), one uint64 per document
  tokenizer.json       the Hugging Face tokenizer that produced the ids
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "moe-train-tokens/1"
DIGEST = "blake2b-"  # a split's digest: this, then the hex of the 32-byte BLAKE2b of its token file


class DataError(ValueError):
    """The data folder is missing, malformed, or incompatible with the model."""


@dataclass
class TokenSplit:
    tokens: np.ndarray  # [N] uint32 memmap
    doc_ends: np.ndarray  # [D] uint64 memmap
    id_bound: int  # the ids the split may hold are below it (the trainer checks each drawn window against it)


def fsync_path(path: Path) -> None:
    """Put a file's bytes, or a folder's entries (its files' creations and renames), on disk. A folder on a file
    system that cannot fsync one (some network and FUSE file systems: EINVAL, ENOTSUP, EBADF) is left as it is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (path.is_dir() and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise OSError(e.errno, f"fsync of {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def naming_the_file(path: str | Path) -> Iterator[None]:
    """An OSError of a write, flush, fsync or close on an open file (which names no file: "[Errno 28] No space left
    on device") re-raised naming `path`, its errno kept, so that the one line the CLI prints says which file system
    refused (review helper 172)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def write_array(f: Any, array: np.ndarray) -> None:
    """array's bytes into the binary file f (opened by path), an error naming it. Not numpy's tofile, whose short
    write on a full disk raised "OSError: 213107 requested and 49152 written", with no errno (the CLI could not
    tell it from a bug) and no file; Python's file write raises ENOSPC (review helper 171)."""
    with naming_the_file(f.name):
        f.write(memoryview(np.ascontiguousarray(array)).cast("B"))


class SplitWriter:
    """Writes one split a chunk of tokens at a time: `{name}.u32`, and `{name}.docs.u64` with the end of every
    document (each ended by eos_id), whose last entry is the split's end even where a block cut a document.
    A context manager: leaving it closes both files, finished or not."""

    def __init__(self, folder: Path, name: str, eos_id: int) -> None:
        self.eos_id, self.num_tokens, self.num_docs, self._last_end = eos_id, 0, 0, 0
        self.max_token_id = -1
        self._digest = hashlib.blake2b(digest_size=32)
        self._tokens = open(folder / f"{name}.u32", "wb")
        self._ends = open(folder / f"{name}.docs.u64", "wb")

    def write(self, tokens: np.ndarray) -> None:
        """tokens: [n] uint32, the split's next ones."""
        tokens = np.ascontiguousarray(tokens, dtype="<u4")
        self._write_ends(np.flatnonzero(tokens == self.eos_id) + (self.num_tokens + 1))
        write_array(self._tokens, tokens)
        self._digest.update(tokens)  # the bytes just written: the file is never read back whole
        self.num_tokens += tokens.size
        if tokens.size:
            self.max_token_id = max(self.max_token_id, int(tokens.max()))

    def finish(self) -> tuple[int, int]:
        """Put the files on disk (not only in the page cache); returns (tokens, documents)."""
        if self.num_tokens and self._last_end != self.num_tokens:  # a block cut inside a document ends the split
            self._write_ends(np.array([self.num_tokens]))
        for f in (self._tokens, self._ends):
            with naming_the_file(f.name):
                f.flush()
                os.fsync(f.fileno())
        return self.num_tokens, self.num_docs

    @property
    def digest(self) -> str:
        """The digest of the token file written so far, as meta.json records it."""
        return DIGEST + self._digest.hexdigest()

    def _write_ends(self, ends: np.ndarray) -> None:
        write_array(self._ends, ends.astype("<u8"))
        self.num_docs += ends.size
        if ends.size:
            self._last_end = int(ends[-1])

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._tokens.close()
        self._ends.close()


def write_meta(folder: Path, meta: dict) -> None:
    _atomic_write_bytes(folder / "meta.json", json.dumps(meta, indent=2).encode())


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _shown(d: object, key: str) -> str:
    return repr(d[key]) if isinstance(d, dict) and key in d else "(missing)"


def read_meta(path: Path) -> dict:
    """meta.json, checked for the keys and types a data folder needs (see the module docstring)."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); expected the meta.json `moe-train prepare-data` writes") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: holds a {type(meta).__name__}, expected a JSON object")
    if meta.get("format") != FORMAT:
        raise DataError(f"{path}: format={meta.get('format')!r}, expected {FORMAT!r}")
    for key in ("vocab_size", "eos_id"):
        if not _is_count(meta.get(key)):
            raise DataError(f"{path}: {key}={_shown(meta, key)}, expected an integer >= 0")
    if meta["eos_id"] >= meta["vocab_size"]:  # the id that ends each document (train.document_masking masks on it)
        raise DataError(f"{path}: eos_id={meta['eos_id']}, expected an id below its vocab_size={meta['vocab_size']}")
    splits = meta.get("splits")
    for name in ("train", "eval"):
        split = splits.get(name) if isinstance(splits, dict) else None
        if not _is_count(split.get("num_tokens") if isinstance(split, dict) else None):
            raise DataError(f"{path}: splits.{name}.num_tokens={_shown(split, 'num_tokens')}, expected an integer >= 0")
        digest = split.get("digest")
        if digest is not None and not (isinstance(digest, str) and digest.startswith(DIGEST)):
            raise DataError(f"{path}: splits.{name}.digest={digest!r}, expected {DIGEST!r} and the hex of its token "
                            "file's BLAKE2b (prepare-data writes it), or no digest")
    return meta


def split_identity(meta: dict, name: str = "train") -> dict:
    """What tells a split's tokens from others: its token count and, where meta.json records it, the digest of its
    token file. Only the token ids count: a tokenizer.json that changed without changing them changes nothing a
    run trains on (one that changes them changes the digest)."""
    split = meta["splits"][name]
    digest = split.get("digest")
    return {"num_tokens": split["num_tokens"], **({"digest": digest} if digest is not None else {})}


def identity_text(identity: dict) -> str:
    """A split_identity in a few words: `blake2b-1a2b3c4d5e6f… (4,691 tokens)`, `4,691 tokens, no digest`."""
    digest, count = identity.get("digest"), identity.get("num_tokens")
    tokens = f"{count:,} tokens" if isinstance(count, int) else f"num_tokens={count!r}"
    return f"{digest[:len(DIGEST) + 12]}… ({tokens})" if isinstance(digest, str) else f"{tokens}, no digest"


def other_tokens(saved: Any, now: dict) -> bool:
    """Whether a checkpoint's record of its training data (`saved`: split_identity then, or not recorded) names
    other tokens than `now` (a split_identity): the digests differ where both have one, else the token counts do."""
    if not isinstance(saved, dict) or not isinstance(saved.get("num_tokens"), int):
        return False  # a checkpoint saved before the trainer recorded it: nothing to compare
    if isinstance(saved.get("digest"), str) and isinstance(now.get("digest"), str):
        return saved["digest"] != now["digest"]
    return saved["num_tokens"] != now["num_tokens"]


def open_data(folder: str | Path, vocab_size: int | None) -> tuple[dict, dict[str, TokenSplit]]:
    """Open a data folder: its meta.json's vocab_size is at most vocab_size (the model's), each split's recorded
    largest id is below it, and each split's `id_bound` is the bound its drawn windows are checked against:
    meta.json's vocab_size (the ids its tokenizer emitted), or the model's for a split without the record.
    vocab_size=None: the folder alone, with no model (`moe-train inspect`); meta.json's vocab_size bounds each split."""
    root = Path(folder)
    if root.exists() and not root.is_dir():
        raise DataError(f"data.path={str(root)!r} is a file: expected a data folder written by `moe-train "
                        "prepare-data` (run it on the file to make one)")
    if not root.is_dir():
        raise DataError(f"data.path={str(root)!r} does not exist (run `moe-train prepare-data` to make one)")
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"data.path={str(root)!r} has no meta.json: expected a folder written by `moe-train prepare-data`")
    meta = read_meta(meta_path)
    if vocab_size is not None and meta["vocab_size"] > vocab_size:  # before any token is read: a scan takes minutes
        raise DataError(f"{meta_path}: the data was tokenized with vocab_size={meta['vocab_size']}, larger than "
                        f"model.vocab_size={vocab_size}: the model cannot embed ids its tokenizer.json emits; "
                        f"set model.vocab_size >= {meta['vocab_size']} (e.g. --model.vocab_size={meta['vocab_size']}), "
                        f"or tokenize the data with a vocabulary of at most {vocab_size} ids (`moe-train prepare-data "
                        f"--vocab-size {vocab_size}` trains one; a --tokenizer brings its own)")
    recorded = {name: meta["splits"][name].get("max_token_id") for name in ("train", "eval")}
    trusted = {name: _is_recorded_id(top, meta["splits"][name]["num_tokens"]) for name, top in recorded.items()}
    for name, top in recorded.items():
        if trusted[name] and top >= meta["vocab_size"]:
            raise DataError(f"{meta_path}: splits.{name}.max_token_id={top} >= its vocab_size={meta['vocab_size']}: "
                            "meta.json does not hold together (moe-train before 0.19.4 recorded a tokenizer's token "
                            "count, short of its largest id + 1 where ids skip, and before 0.27.25 left out ids a "
                            "post-processor adds; or meta.json was edited or damaged); prepare the data again")
    splits: dict[str, TokenSplit] = {}
    for name in ("train", "eval"):
        tok_path, doc_path = root / f"{name}.u32", root / f"{name}.docs.u64"
        if not tok_path.is_file():
            raise DataError(f"missing token file {tok_path}")
        size = tok_path.stat().st_size
        if size % 4:
            raise DataError(f"{tok_path}: size {size} bytes is not a multiple of 4 (uint32 tokens); the file is truncated")
        tokens = np.memmap(tok_path, dtype="<u4", mode="r") if size else np.zeros(0, dtype=np.uint32)
        expected = meta["splits"][name]["num_tokens"]
        if expected != tokens.size:
            raise DataError(f"{tok_path}: holds {tokens.size} tokens ({size} bytes of uint32) but meta.json says "
                            f"{expected}; the file is truncated, or not of this meta.json")
        doc_ends = _doc_ends(doc_path, tokens.size)
        # A split whose largest id prepare-data recorded is within meta.json's vocab_size (checked above); one from
        # before the record (0.16.0) is read once, and bounded by the model's vocabulary alone (its vocab_size may
        # count tokens rather than ids, see above), as before 0.27.25. Either way each batch is checked again as it
        # is drawn (check_token_ids): a file changed after meta.json was written.
        bound = meta["vocab_size"] if trusted[name] or vocab_size is None else vocab_size
        top = -1 if trusted[name] or not tokens.size else int(_chunked_max(tokens))
        if top >= bound and vocab_size is None:
            raise ids_past_the_vocabulary(tok_path, top, f"meta.json's vocab_size={bound}", "found by a scan of the "
                                          "split (meta.json records no largest id)")
        if top >= bound:
            raise ids_past_the_vocabulary(tok_path, top, f"model.vocab_size={vocab_size}", "past the folder's own "
                                          f"vocabulary too (meta.json: vocab_size={meta['vocab_size']}; found by a "
                                          "scan of the split)")
        splits[name] = TokenSplit(tokens, doc_ends, bound)
    return meta, splits


def _doc_ends(path: Path, num_tokens: int) -> np.ndarray:
    """[D] uint64 of the split's document ends, mapped rather than read: 8 bytes a document (10^8 short documents
    are 800 MB) that training never reads. No file: one document, the whole split."""
    if not path.is_file():
        return np.array([num_tokens], dtype=np.uint64)
    count = path.stat().st_size // 8  # as np.fromfile read it: a partial last entry left out
    return np.memmap(path, dtype="<u8", mode="r", shape=(count,)) if count else np.zeros(0, dtype=np.uint64)


def _is_recorded_id(v: object, num_tokens: int) -> bool:
    """v can be the largest id of num_tokens uint32 tokens (-1 when there are none); else the split is scanned."""
    if not isinstance(v, int) or isinstance(v, bool):
        return False
    return v == -1 if num_tokens == 0 else 0 <= v < 2**32


def ids_past_the_vocabulary(where: object, top: int, bound: str, found: str) -> DataError:
    """A token id past the folder's own vocabulary (meta.json's, at most the model's: open_data checks it): its token
    file and meta.json no longer match. Not "set model.vocab_size >= id + 1", which would train on the damage.
    bound: the limit crossed, named ("vocab_size=300"); found: how the id got past the earlier checks."""
    return DataError(f"{where}: token id {top} >= {bound}, {found}: the token file and its "
                     "meta.json no longer match (one of them changed after prepare-data wrote them, or was damaged); "
                     "prepare the data again")


def check_token_ids(window: np.ndarray, vocab_size: int, tokens: np.ndarray, start: int) -> None:
    """A drawn window of `tokens` (from token `start`) holds no id >= vocab_size (the trainer passes the split's
    `id_bound`: meta.json's vocab_size, or the model's for a folder without recorded largest ids): past the model's,
    the embedding would index past its table (on a GPU, a device-side assert that ends the process without naming
    the data); past the data's alone, it would train on damage. The folder was checked when opened; this finds a
    token file changed since its meta.json was written."""
    if window.size and int(window.max()) >= vocab_size:
        first = int(np.argmax(window >= vocab_size))
        name = getattr(tokens, "filename", None) or "the token stream"
        raise ids_past_the_vocabulary(f"{name} at token {start + first}", int(window[first]), f"vocab_size="
                                      f"{vocab_size}", "the split's bound when the run opened it (meta.json's "
                                      "vocab_size; model.vocab_size for a folder prepared before moe-train 0.16.0), "
                                      "though the split passed the id check then (meta.json's largest id, or a scan)")


def _chunked_max(tokens: np.ndarray, chunk: int = 1 << 26) -> int:
    return max(int(tokens[i : i + chunk].max()) for i in range(0, tokens.size, chunk))
