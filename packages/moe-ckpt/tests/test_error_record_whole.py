"""A rank's error record is read by the other ranks while it is written: they must see it whole or not at all.

It was written with open + write: a reader in between saw "rank-00000: " with the cause missing. A local test run
failed on it (test_qa52's metadata case: rank 1 said "not writing step-00000002.tmp: rank-00000: " instead of naming rank
0's unserialisable metadata). Here one process rewrites a record as fast as it can while this one reads it:
about half the reads were cut short on the old code.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
from ckpt_cases import start_forked

from moe_ckpt.save import _read_errors, _record_error
from moe_ckpt.shard_file import write_text_atomic

CAUSE = "ValueError: " + "the whole cause" * 300
READ_S = 1.5


def _rewrite_record(tmp: str, stop) -> None:  # noqa: ANN001 - a multiprocessing Event
    error = ValueError(CAUSE.removeprefix("ValueError: "))
    while not stop.is_set():
        _record_error(Path(tmp), 0, error)


def test_a_record_being_rewritten_is_always_read_whole(tmp_path):
    _record_error(tmp_path, 0, ValueError(CAUSE.removeprefix("ValueError: ")))
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    writer = ctx.Process(target=_rewrite_record, args=(str(tmp_path), stop))
    start_forked(writer)
    reads, cut = 0, []
    try:
        deadline = time.monotonic() + READ_S
        while time.monotonic() < deadline:
            text = _read_errors(tmp_path)
            reads += 1
            if text != f"rank-00000: {CAUSE}":
                cut.append(len(text))
    finally:
        stop.set()
        writer.join(timeout=30)
    assert writer.exitcode == 0
    assert reads >= 100, f"only {reads} reads in {READ_S} s: the race was not exercised"
    assert not cut, f"{len(cut)} of {reads} reads saw a partial record (lengths {sorted(set(cut))[:5]})"
    assert [p.name for p in tmp_path.iterdir()] == ["rank-00000.error"]  # no temporary left beside it


def test_a_failed_write_leaves_neither_the_record_nor_a_temporary(tmp_path, monkeypatch):
    def fail(*_args):  # noqa: ANN002
        raise OSError("disk full")

    monkeypatch.setattr("moe_ckpt.shard_file.os.replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(tmp_path / "rank-00001.error", "the cause")
    assert list(tmp_path.iterdir()) == []
