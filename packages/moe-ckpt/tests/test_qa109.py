"""QA 109: an I/O error at every file-system operation a checkpoint load makes, on one process and on two gloo ranks.

What was tried. fs_faults.Faults(root, reads=True) counts, besides QA 105's calls, what a load makes (read from
load.py, index.py, shard_file.py, run_dir.py, summary.py): os.stat / os.lstat (Path.exists, is_file, is_dir,
is_symlink, stat), os.listdir (Path.iterdir), open to read, os.fstat and read / readinto of a file it opened, and
safetensors' safe_open (which opens and maps the file in Rust: its fault is raised at the call, as safetensors raises
an I/O error). Not injectable: an I/O error reading a mapped shard's bytes (get_slice / get_tensor) is a SIGBUS in
Rust, not a call. The load of a run folder with two committed checkpoints (resolve + find_latest, index.json, every
shard file's stat, checksum pass and safe_open, the pieces' reads, then metadata.json) is enumerated, then:
(a) one process: operation i = 1..n fails with EIO, each in turn (31 operations, every kind above);
(b) two gloo ranks (started once by the forkserver, collective timeout 5 s), each loading its own rows inside
    fail_together, then load_metadata inside a second fail_together (the two phases a resume has): every operation
    of rank 0 alone, every one of rank 1 alone, and both ranks at once at different operations (rank 1 at rank 0's
    index shifted by a third of the count, so that many pairs land in different phases).
After each: the rank at fault raises an error naming the file of the failed operation; every other rank raises
(PeerCheckpointError, or its own error); no rank waits for the collective timeout (each raises within 2 s) and the
ranks stay in step (a collective afterwards agrees); nothing on disk changed (names, sizes, bytes) and a load never
made a write operation; a clean load afterwards is bit-exact. A corrupt file still names itself.

Defects found (each fails on the code before its fix; see the tests below):
1. A read error inside a file reached the caller naming no file: "[Errno 5] Input/output error" alone, for the read
   of index.json (read_index) and of metadata.json (load_metadata), and for the os.fstat and reads of the checksum
   pass over a shard file (file_checksum). shard_file.naming now names the file there, as QA 105 did for writes.
2. An I/O error opening a shard file (safe_open's OSError) was reported as CorruptShardError, "not a readable
   safetensors file": a damaged-file error for a disk that failed a read, which moe-train turns into "cannot be
   resumed from ... move the damaged one aside". Now an OSError naming the file; safetensors' own error type (an
   unreadable header) is still CorruptShardError.
No hang: moe-ckpt's load makes no collective; with each phase inside fail_together every rank raises at the phase
of the first fault on any rank. moe-train's resume has one read outside it (tests/test_qa109.py there).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_cases import bits_equal, free_port, shards_for
from ckpt_qa109_worker import STATE1, STATE2, TIMEOUT_S, message, rank_main, snapshot
from fs_faults import LISTING, Faults, memory_folder

from moe_ckpt import (
    ChecksumMismatchError, CorruptMetadataError, CorruptShardError, inspect_checkpoint, load_checkpoint, load_metadata,
    save_checkpoint, step_dir,
)

READ_OPS = {"os.stat", "os.lstat", LISTING, "open(r)", "open(rb)", "os.fstat", "file.read", "file.readinto",
            "safe_open"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder with steps 1 and 2 committed by one rank (a load of it reads step 2)."""
    with memory_folder(tmp_path_factory.mktemp("qa109"), "qa109-") as path:
        save_checkpoint(step_dir(path / "run", 1), shards_for(STATE1, 0, 1), {"step": 1})
        save_checkpoint(step_dir(path / "run", 2), shards_for(STATE2, 0, 1), {"step": 2})
        yield path / "run"


def _load(run: Path, requests=None) -> dict:
    got = load_checkpoint(run, requests)
    assert load_metadata(run)["step"] == 2
    return got


# ---------------------------------------------------------------------------------------------------------------
# one process


def test_a_load_is_enumerated_and_makes_only_reads(run, monkeypatch):
    faults = Faults(run, reads=True)
    with faults.active(monkeypatch):
        _load(run)
    kinds = {op for op, _ in faults.ops}
    assert kinds == READ_OPS, sorted(kinds ^ READ_OPS)  # every kind of read, and no write
    names = {Path(p).name for _, p in faults.ops}
    assert {"index.json", "metadata.json", "shard-00000-of-00001.safetensors", "step-00000001"} <= names, names


def test_an_io_error_at_any_operation_of_a_load_names_the_file_and_changes_nothing(run, monkeypatch):
    before = snapshot(run)
    faults = Faults(run, reads=True)
    with faults.active(monkeypatch):
        _load(run)
    n = len(faults.ops)
    for i in range(1, n + 1):
        faults = Faults(run, reads=True)
        with faults.active(monkeypatch, fail_at=i, kind="EIO"), pytest.raises(OSError) as caught:
            _load(run)
        op, failed = faults.failed
        where = f"EIO at operation {i} of {n}, {op} {os.path.relpath(failed, run)}: {message(caught.value)}"
        assert os.path.basename(failed) in str(caught.value), where
        # an I/O error is not reported as a damaged checkpoint (moe-train would tell the user to move it aside)
        assert not isinstance(caught.value, (CorruptShardError, CorruptMetadataError, ChecksumMismatchError)), where
    assert snapshot(run) == before
    got = _load(run)
    assert all(bits_equal(got[k], STATE2[k]) for k in STATE2)


def test_an_io_error_opening_a_shard_is_an_oserror_naming_it_and_a_damaged_header_is_still_corrupt(run, monkeypatch,
                                                                                                    tmp_path):
    faults = Faults(run, reads=True)
    with faults.active(monkeypatch):
        _load(run)
    at = next(i for i, (op, _) in enumerate(faults.ops, 1) if op == "safe_open")
    with Faults(run, reads=True).active(monkeypatch, fail_at=at, kind="EIO"), \
            pytest.raises(OSError, match=r"shard-00000-of-00001\.safetensors could not be opened") as caught:
        _load(run)
    assert not isinstance(caught.value, CorruptShardError)
    # corrupt files still say which file
    ck = tmp_path / "ck"
    shutil.copytree(step_dir(run, 2), ck)
    shard = ck / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"shard-00000-of-00001\.safetensors"):
        load_checkpoint(ck)
    raw[:8] = (1 << 40).to_bytes(8, "little")  # a header longer than the file, same size: safetensors refuses it
    shard.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match=r"shard-00000-of-00001\.safetensors is not a readable"):
        load_checkpoint(ck, verify=False)
    (ck / "metadata.json").write_text("{")
    with pytest.raises(CorruptMetadataError, match=r"metadata\.json"):
        inspect_checkpoint(ck)


# ---------------------------------------------------------------------------------------------------------------
# two gloo ranks (started once by the forkserver, from ckpt_qa109_worker.py)

def test_two_gloo_ranks_an_io_error_on_one_or_both_ranks_fails_every_rank_at_once_naming_the_file(tmp_path):
    import torch.multiprocessing as mp

    with memory_folder(tmp_path, "qa109-dist-") as root:
        try:
            mp.start_processes(rank_main, args=(2, free_port(), str(root), str(tmp_path)), nprocs=2, join=True,
                               start_method="forkserver")
        finally:
            reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
                       if (tmp_path / f"rank{r}.pt").exists() else {"error": "no report"} for r in range(2)]
            errors = [f"rank {r}:\n{rep['error']}" for r, rep in enumerate(reports) if "error" in rep]
            assert not errors, "\n".join(errors)
    zero, one = reports
    assert zero["unchanged"], "a load changed the files of the run folder"
    assert len(zero["cases"]) == len(one["cases"]) >= 60
    scenarios = set()
    for pair in zip(zero["cases"], one["cases"]):
        where = (f"{pair[0]['scenario']} at operations {pair[0]['fail_at']}: {pair[0]['failed']} / "
                 f"{pair[1]['failed']}: rank 0 {pair[0]['outcome']!r}, rank 1 {pair[1]['outcome']!r}")
        scenarios.add(pair[0]["scenario"])
        faulted = [r for r in range(2) if pair[r]["failed"] is not None]
        assert faulted, where
        for r, case in enumerate(pair):
            assert case["outcome"] != "ok", where  # every rank raises
            assert case["seconds"] < TIMEOUT_S / 2.5, where  # promptly, not at the collective timeout
            assert case["then"] == 2, where
            if r in faulted and case["kind"] != "PeerCheckpointError":  # its own error, naming the file
                assert os.path.basename(case["failed"][1]) in case["outcome"], where
            elif r not in faulted:
                assert case["kind"] == "PeerCheckpointError", where
        # with both at fault, the first phase to fail stops both: one of them raises its own error
        assert any(pair[r]["kind"] != "PeerCheckpointError" for r in faulted), where
    assert scenarios == {"rank 0", "rank 1", "both"}
