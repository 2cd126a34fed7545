"""Where prepare-data's documents come from, read a file at a time (a corpus need not fit in memory): the text
files given, or the embedded default corpus, the running interpreter's own standard-library source files.

The default corpus exists on every machine with Python, needs no download, and is deterministic for a given
Python build (files are read in sorted order).
"""

from __future__ import annotations

import sysconfig
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from moe_train.data.token_file import DataError


class Documents:
    """Documents read afresh on every pass over them, e.g. one file at a time: training a BPE reads a corpus
    twice, and a pretraining corpus does not fit in memory. `read` returns a new iterator over the texts."""

    def __init__(self, read: Callable[[], Iterator[str]]) -> None:
        self._read = read

    def __iter__(self) -> Iterator[str]:
        return self._read()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_bytes: int) -> Documents:
    """Source files of the standard library (one document each) until max_bytes are read."""
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")

    def read() -> Iterator[str]:
        seen = 0
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            yield text
            seen += len(text.encode())
            if seen >= max_bytes:
                return

    return Documents(read)


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{str(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
                        "prepare-data reads UTF-8 text files; convert it or leave it out") from None


def text_file_documents(paths: list[str]) -> Documents:
    """Each given file is one document, read when the documents are; folders contribute their *.txt, *.md and
    *.py files, the suffix in any case (NOTES.TXT from Windows is text too), but none under a hidden name (.venv,
    .git, .ipynb_checkpoints: a project folder's virtual environment would give every installed package's source; a
    warning says how many were left out); a hidden file named on its own is read. A file named twice (or both by name and through its folder) is read once; a
    file that is not UTF-8 is refused. A missing path is refused at once."""
    files: dict[Path, Path] = {}  # resolved -> as given, in order
    for p in map(Path, paths):
        if p.is_dir():
            found, hidden = [], []
            for q in sorted(q for q in p.rglob("*") if q.suffix.lower() in (".txt", ".md", ".py") and q.is_file()):
                (hidden if any(part.startswith(".") for part in q.relative_to(p).parts) else found).append(q)
            if hidden:  # said, or a folder whose text is all under hidden names gives only '0 given'
                warnings.warn(f"{str(p)!r}: {len(hidden)} text file{'' if len(hidden) == 1 else 's'} under a hidden "
                              f"name left out (e.g. {hidden[0]}); a file named on its own is read")
        elif p.is_file():
            found = [p]
        else:
            raise FileNotFoundError(f"input path {str(p)!r} does not exist")
        for f in found:
            files.setdefault(f.resolve(), f)
    return Documents(lambda: map(_read_text, files.values()))
