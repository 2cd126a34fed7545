"""The embedded default corpus: the running interpreter's own standard-library source files.

It exists on every machine with Python, needs no download, and is deterministic for a given
Python build (files are read in sorted order).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_bytes: int) -> Iterator[str]:
    """Yield source files of the standard library (one document each) until max_bytes are read."""
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
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


def text_file_documents(paths: list[str]) -> Iterator[str]:
    """Each given file is one document; folders contribute their *.txt, *.md and *.py files."""
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(q for q in p.rglob("*") if q.suffix in (".txt", ".md", ".py") and q.is_file()):
                yield f.read_text(encoding="utf-8", errors="replace")
        elif p.is_file():
            yield p.read_text(encoding="utf-8", errors="replace")
        else:
            raise FileNotFoundError(f"input path {str(p)!r} does not exist")
