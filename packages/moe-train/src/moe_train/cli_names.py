"""The library's refusals name its parameters (`vocab_size=10: expected >= 257`, `out_dir='x' is a file`), as its
callers typed them; a `moe-train` user typed flags and arguments. `typed_as` rewrites what a library call raises or
warns into the names the user typed, leaving the library's own messages as they are for library callers:

    with typed_as(PREPARE_NAMES, passed):        # passed: the keyword arguments given to the library call
        prepare_data(docs, out, **passed)        # vocab_size=10: ...  ->  --vocab-size=10: ...

An option is written `--flag=value`; a positional argument by its name on argparse's usage line
(`moe-train export-hf ... checkpoint out`), so `out='x'`. The value stays as the library wrote it.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

# {library parameter: what the user typed for it}, for each command that calls a library with flags' values.
# Booleans (--custom-code, --allow-benchmark-routing) are left out: the library names them only with the value the
# user did not give (`allow_benchmark_routing=True`), and its messages name the flag beside them already.
PREPARE_NAMES = {"vocab_size": "--vocab-size", "tokenizer_path": "--tokenizer", "eos_token": "--eos-token",
                 "eval_fraction": "--eval-fraction"}
EXPORT_NAMES = {"out_dir": "out", "dtype": "--dtype", "tokenizer_json": "--tokenizer",
                "max_shard_bytes": "--max-shard-bytes", "push_to_hub": "--push-to-hub"}
IMPORT_NAMES = {"out_dir": "out"}


def _spellings(value: object) -> set[str]:
    """How a library message may write `value`: as given or its repr, and a path also as Path() gives it (no
    trailing slash), absolute, or with its links resolved (a link to a folder is written through)."""
    if isinstance(value, (str, os.PathLike)):
        paths = {os.fspath(value), str(Path(value)), os.path.abspath(value), os.path.realpath(value)}
        return {spelled for p in paths for spelled in (p, repr(p))}
    return {str(value), repr(value)}


def in_typed_names(message: str, names: Mapping[str, str], passed: Mapping[str, object]) -> str:
    """`message` with `param=<the value passed>` as `<what the user typed>=<value>`, for each param of `names`.

    Only a whole `param=` (not `model.vocab_size=`, nor a path's `runs/out_dir=1`) followed by the value the command
    passed for it: the same name with another value is something else (`meta.json records vocab_size=282`), and a
    bare `tokenizer_json=` speaks to library callers. A name with an underscore, alone (`choose another out_dir`), is
    the parameter too, but never inside a value: a path or file name (`hf/out_dir`, `eos_token.txt`), or anything
    the message quotes (`'out_dir'`, an input `'eos_token'`), is left as written."""
    for param, typed in names.items():
        value = passed.get(param)
        if value is not None:
            values = "|".join(re.escape(s) for s in sorted(_spellings(value), key=len, reverse=True))
            message = re.sub(rf"(?<![\w.\-/\\]){param}=({values})(?!\w)", lambda m: f"{typed}={m[1]}", message)
    bare = [param for param in names if "_" in param]  # `dtype` alone is a word ("in that dtype")
    if not bare:
        return message
    kept = _values_in(message, names, passed)
    # not inside a path or a file's name: runs/out_dir, eos_token.txt
    alone = re.compile(rf"(?<![\w.\-/\\])({'|'.join(map(re.escape, bare))})(?![\w=/\\]|\.\w)")
    return alone.sub(lambda m: m[0] if any(a <= m.start() < b for a, b in kept) else names[m[1]], message)


# A value a message quotes, as repr writes it: a quote after no letter (not the apostrophe of "model's") up to the next
QUOTED = re.compile(r"(?<!\w)('[^'\n]*'|\"[^\"\n]*\")(?!\w)")


def _values_in(message: str, names: Mapping[str, str], passed: Mapping[str, object]) -> list[tuple[int, int]]:
    """Where `message` writes a value, not a parameter: anything it quotes ('out_dir', an input 'eos_token'), and a
    value passed written bare after its `typed=`."""
    spans = [m.span() for m in QUOTED.finditer(message)]
    for param, typed in names.items():
        value = passed.get(param)
        if value is not None:
            for spelled in _spellings(value):
                spans += [m.span() for m in re.finditer(rf"(?<={re.escape(typed)}=){re.escape(spelled)}", message)]
    return spans


@contextlib.contextmanager
def typed_as(names: Mapping[str, str], passed: Mapping[str, object]) -> Iterator[None]:
    """Errors raised and warnings shown in the block name what the user typed (`in_typed_names`). An error keeps its
    type and traceback: only its message is rewritten."""
    show = warnings.showwarning

    def show_typed(message, category, filename, lineno, file=None, line=None):
        show(in_typed_names(str(message), names, passed), category, filename, lineno, file, line)

    warnings.showwarning = show_typed
    try:
        yield
    except Exception as e:
        if len(e.args) == 1 and isinstance(e.args[0], str):
            e.args = (in_typed_names(e.args[0], names, passed),)
        raise
    finally:
        warnings.showwarning = show
