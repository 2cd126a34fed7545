"""QA 105: fault injection at every file-system operation a checkpoint save makes, one at a time.

What was tried. The functions the save code calls (read from save.py, shard_file.py, run_dir.py) are wrapped in
process while the save runs (fs_faults.py beside this file; moe-ckpt itself is not mocked): builtins/io `open`
(and `write`, `flush`, `close` of a file it opened to write), os.open, os.close, os.fsync, os.fdatasync, os.replace,
os.rename, os.remove, os.unlink, os.rmdir, os.mkdir (Path.mkdir), os.listdir and os.scandir (Path.iterdir: listdir before Python 3.13, scandir from it; Path.glob)
and shutil.rmtree (one operation; with ignore_errors=True its fault removes nothing and raises nothing, as a real
failing rmtree told to ignore errors). Only operations on paths inside the run folder count; stat calls
(Path.exists, is_dir, ...), reads of file contents and json (no file-system calls of its own) are not injected. A
fault is raised as the real call raises it: an OSError naming its path(s) for calls that take one, naming none
for calls on a file descriptor (write, fsync, close). A clean save of step 2 (after a committed step 1, with
`latest`, a killed save's step-N.tmp and a .latest.tmp-* leftover, keep_last_n=1 so that retention deletes step 1)
is enumerated once (63 operations: leftovers, tmp folder, shard file, manifest, metadata.json, index.json, the
rename, folder fsyncs, `latest`, retention); then operation i = 1..63 fails with ENOSPC through save_checkpoint,
and at every third operation also with EIO and with a BaseException that is not an Exception (as
KeyboardInterrupt); through AsyncCheckpointer, ENOSPC and the interrupt at every third. After each: the error
reaches the caller naming the path of the failed operation; the newest committed checkpoint is step 1 or a complete
step 2, each bit-exact; `latest` names a complete checkpoint; find_latest, load_checkpoint and inspect_checkpoint of
the run folder never pick a partial step, and step 2, when not committed, is refused naming it; what is left with
.tmp in its name is ignored by every reader (and is only what the docs allow: retention's doomed folder, leftovers
whose removal failed); step 1 is never deleted unless step 2 committed; the retry of the same save succeeds (or,
where step 2 committed, is refused as existing and the next step saves) and leaves the run folder as a clean save
does. Through 2 gloo ranks (started once by the forkserver): each of rank 0's 63 and rank 1's 16 operations fails
in turn with ENOSPC; every rank raises or none does, with the same number of barriers, nothing is committed unless
the commit happened, step 1 (or the committed step 2) loads bit-exactly, a retry commits. Also metadata.json /
index.json edited by hand (a value of the wrong type, damaged JSON, a listed shard missing): refused naming file
and field. moe-train's tests/test_qa105.py does the same through the Trainer's save, resume and `moe-train inspect`.

Defects found (each verified to fail before its fix: HEAD's src, with the other fixes applied for 2 and 3):
1. An error of a call on a file descriptor reached the caller naming no file: file.write / flush / os.fsync /
   close of a shard file or of metadata.json's, index.json's, a manifest's or `latest`'s temporary file, and the
   folder fsync (fsync_dir) of the tmp folder and the run folder, with ENOSPC or EIO, raised "[Errno 28] No space
   left on device" alone (on every rank of a 2-rank save: "not committing ...: rank-00001: OSError: [Errno 28] No
   space left on device"). shard_file.naming re-raises such an error naming the file (type, errno, traceback kept).
2. `latest`'s temporary file (.latest.tmp-*) was left beside the checkpoints when writing or replacing it failed
   (write_latest had no cleanup, unlike write_text_atomic; the next save removed it). write_latest now goes
   through write_text_atomic, which removes its temp file on failure (keeping the .latest.tmp-<hex> name).
3. The run folder's fsync right after the rename (fsync_dir(path.parent) in save._commit) failing on rank 0
   (os.open / fsync / close, ENOSPC or EIO): the checkpoint was committed, rank 0 raised, and the other ranks
   returned as if the save succeeded, to wait for rank 0 at their next collective; the failure was outside the
   block that records post-commit failures for every rank. Moved inside it: every rank raises "committed, then
   rank 0 failed", as for a failure moving `latest`.
Left alone: a leftover `.latest.tmp-*` file that cannot be removed fails the save (os.unlink in remove_leftovers),
while a leftover folder that cannot be removed is skipped (rmtree ignore_errors); both only before anything is
written, and the retry succeeds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_cases import bits_equal, free_port, make_state, shards_for
from fs_faults import LISTING, Faults, Interrupted, memory_folder

from moe_ckpt import (
    AsyncCheckpointer, CorruptMetadataError, IncompleteCheckpointError, MissingShardFileError,
    find_latest, inspect_checkpoint, list_checkpoints, load_checkpoint, load_metadata, open_checkpoint,
    save_checkpoint, step_dir, verify_checkpoint,
)
from moe_ckpt.run_dir import read_latest

from ckpt_qa105_worker import rank_main


# ---------------------------------------------------------------------------------------------------------------
# one process


STATE1, STATE2 = make_state(1), make_state(2)


def _template(root: Path) -> None:
    """A run folder with step 1 committed (latest names it), a killed save's step-7.tmp and a .latest.tmp-*."""
    save_checkpoint(step_dir(root, 1), shards_for(STATE1, 0, 1), {"step": 1})
    killed = root / "step-00000007.tmp"
    killed.mkdir()
    (killed / "shard-00000-of-00001.safetensors").write_bytes(b"\0" * 16)
    (root / f".latest.tmp-{'ab' * 16}").write_text("step-00000007\n")


def _bit_exact(ck: Path, state: dict) -> None:
    got = load_checkpoint(ck)
    assert set(got) == set(state), ck
    for name, t in state.items():
        assert bits_equal(got[name], t), f"{ck}: {name} differs"


def _state_of(ck: Path) -> dict:
    return {1: STATE1, 2: STATE2, 3: STATE2}[int(ck.name.removeprefix("step-"))]


def _save(root: Path, step: int, how: str) -> None:
    path, shards, meta = step_dir(root, step), shards_for(_state_of(step_dir(root, step)), 0, 1), {"step": step}
    if how == "sync":
        save_checkpoint(path, shards, meta, keep_last_n=1)
    else:
        ck = AsyncCheckpointer()
        ck.save(path, shards, meta, keep_last_n=1)
        ck.wait()


def _message(e: BaseException) -> str:
    return f"{e} {' '.join(getattr(e, '__notes__', []))}"


def _check_after_fault(root: Path, faults: Faults, outcome: BaseException | None, kind: str) -> list[str]:
    """The checks after a save whose operation faults.failed failed; returns what is left with .tmp in its name."""
    op, failed_path = faults.failed
    s1, s2 = step_dir(root, 1), step_dir(root, 2)
    where = f"{kind} at {op} {os.path.relpath(failed_path, root)}"
    committed = (s2 / "index.json").is_file()
    if outcome is None:  # only a fault the code may swallow: an rmtree told to ignore errors
        assert op == "shutil.rmtree(ignore_errors)" and committed, f"{where}: the save returned"
    elif kind == "interrupt":
        assert isinstance(outcome, Interrupted), f"{where}: {type(outcome).__name__}: {outcome}"
    else:
        assert isinstance(outcome, Exception), f"{where}: {outcome!r}"
        # the path of the failed operation is named (its own name, or the folder's when the record says "rank-0")
        assert os.path.basename(failed_path) in _message(outcome), f"{where}: {type(outcome).__name__}: {outcome}"
    # the newest committed checkpoint is step 1 or a complete step 2, bit for bit; step 1 goes only for a step 2
    found = list_checkpoints(root)
    assert found[-1] == (s2 if committed else s1), (where, found)
    assert committed or found == [s1], (where, found)
    for ck in found:
        _bit_exact(ck, _state_of(ck))
    assert find_latest(root) == found[-1]
    _bit_exact(root, _state_of(found[-1]))  # the run folder reads as its newest complete checkpoint
    assert inspect_checkpoint(root)["path"] == str(found[-1]), where
    pointed = read_latest(root)
    if pointed is not None:
        assert pointed in found, (where, pointed)
    if not committed:
        with pytest.raises(IncompleteCheckpointError, match=str(s2)):
            load_checkpoint(s2)
    return sorted(p.name for p in root.iterdir() if ".tmp" in p.name)


def _retry_and_check(root: Path, how: str, committed: bool, where: str) -> None:
    if committed:  # a retry of a committed save is refused naming it; the next step saves
        with pytest.raises(FileExistsError, match=str(step_dir(root, 2))):
            _save(root, 2, how)
        _save(root, 3, how)
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000003"], where
        _bit_exact(step_dir(root, 3), STATE2)
        return
    _save(root, 2, how)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"], where
    assert read_latest(root) == step_dir(root, 2)
    _bit_exact(step_dir(root, 2), STATE2)


@pytest.fixture(scope="module")
def fast_dir(tmp_path_factory):
    """A folder in memory where there is one: some 1,000 saves, each of 8 fsyncs, take ~30 s on disk."""
    with memory_folder(tmp_path_factory.mktemp("qa105"), "qa105-") as path:
        yield path


@pytest.fixture(scope="module")
def template(fast_dir) -> Path:
    root = fast_dir / "template"
    _template(root)
    return root


@pytest.fixture
def tmp_path(fast_dir, request) -> Path:  # noqa: F811 - this module's saves go to the in-memory folder
    path = fast_dir / request.node.name.replace("[", "-").replace("]", "")
    path.mkdir()
    return path


def _fresh(template: Path, tmp_path: Path, i: int) -> Path:
    root = tmp_path / f"run{i}"
    shutil.copytree(template, root)
    return root


def test_every_operation_of_a_save_is_enumerated(template, tmp_path, monkeypatch):
    root = _fresh(template, tmp_path, 0)
    faults = Faults(root)
    with faults.active(monkeypatch):
        _save(root, 2, "sync")
    kinds = {op for op, _ in faults.ops}
    # what the protocol does: remove leftovers, write shard + manifest, metadata.json and index.json (temp name +
    # fsync + replace), rename the folder, fsync folders, move `latest`, retention's rename + rmtree
    assert {"open(wb)", "file.write", "os.fsync", "os.replace", "os.rename", "os.open", "os.close", "os.mkdir",
            "shutil.rmtree(ignore_errors)", "os.unlink", LISTING} <= kinds, sorted(kinds)
    names = " ".join(p for _, p in faults.ops)
    for written in ("index.json", "metadata.json", ".latest.tmp-", "shard-00000-of-00001.safetensors",
                    "manifest.json", "step-00000001.tmp-delete-", "step-00000007.tmp"):
        assert written in names, (written, faults.ops)
    assert 30 <= len(faults.ops) <= 120, faults.ops


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_fault_at_any_operation_of_a_save_leaves_the_last_complete_checkpoint_and_a_retry_succeeds(
        template, tmp_path, monkeypatch, how):
    counted = _fresh(template, tmp_path, "count")
    faults = Faults(counted)
    with faults.active(monkeypatch):
        _save(counted, 2, how)
    n = len(faults.ops)
    tried = 0
    for i in range(1, n + 1):
        # sync: ENOSPC at every operation, EIO and an interrupt at every third (offset apart); async (the same save
        # on a thread): ENOSPC and an interrupt at every third
        if how == "sync":
            kinds = ["ENOSPC"] + (["EIO"] if i % 3 == 0 else []) + (["interrupt"] if i % 3 == 1 else [])
        else:
            kinds = ["ENOSPC"] if i % 3 == 2 else ["interrupt"] if i % 3 == 1 else []
        for kind in kinds:
            root = _fresh(template, tmp_path, f"{i}{kind}")
            faults = Faults(root)
            outcome = None
            with faults.active(monkeypatch, fail_at=i, kind=kind):
                try:
                    _save(root, 2, how)
                except BaseException as e:  # noqa: BLE001 - checked below
                    outcome = e
            assert faults.failed is not None, f"operation {i} of {n} never happened: {faults.ops}"
            where = f"{how} {kind} at operation {i} {faults.failed}"
            committed = (step_dir(root, 2) / "index.json").is_file()
            left = _check_after_fault(root, faults, outcome, kind)
            # left with .tmp in its name: the template's leftovers when removing them failed, retention's doomed step 1
            # (removed by the next save), step 2's tmp folder only when removing it failed; never `latest`'s temp file
            allowed = {"step-00000007.tmp", ".latest.tmp-" + "ab" * 16}
            if faults.failed[0].startswith("shutil.rmtree"):
                allowed.add("step-00000002.tmp")
            assert all(n in allowed or n.startswith("step-00000001.tmp-delete-") for n in left), (where, left)
            _retry_and_check(root, how, committed, where)
            tried += 1
            shutil.rmtree(root)
    assert tried >= (n + n // 3 if how == "sync" else 2 * (n // 3))


# ---------------------------------------------------------------------------------------------------------------
# metadata.json and index.json edited by hand


def test_hand_edited_metadata_and_index_are_refused_naming_the_file_and_field(template, tmp_path):
    root = _fresh(template, tmp_path, "edit")
    ck = step_dir(root, 1)
    meta_text, index_text = (ck / "metadata.json").read_text(), (ck / "index.json").read_text()

    (ck / "metadata.json").write_text(meta_text[: len(meta_text) // 2])  # cut short
    with pytest.raises(CorruptMetadataError, match=r"metadata\.json is damaged"):
        load_metadata(ck)
    (ck / "metadata.json").write_text("[1, 2]")  # valid JSON, not an object
    with pytest.raises(CorruptMetadataError, match=r"metadata\.json holds a JSON list"):
        load_metadata(ck)
    (ck / "metadata.json").write_text(meta_text)

    index = json.loads(index_text)
    for field, value, said in [("world_size", "1", "world_size='1'"), ("version", 1.5, "'version'"),
                               ("checksum_algorithm", 32, "checksum_algorithm=32"), ("files", [], "'files'")]:
        (ck / "index.json").write_text(json.dumps({**index, field: value}))
        with pytest.raises(CorruptMetadataError, match=r"index\.json") as caught:
            load_checkpoint(ck)
        assert said in str(caught.value), (field, str(caught.value))
    tensor = next(iter(index["tensors"]))
    bad = json.loads(index_text)
    bad["tensors"][tensor]["shape"] = "8x6x5"
    (ck / "index.json").write_text(json.dumps(bad))
    with pytest.raises(CorruptMetadataError, match=rf"index\.json.*tensor {tensor!r}: shape '8x6x5'"):
        inspect_checkpoint(ck)
    (ck / "index.json").write_text(index_text[:-10])
    with pytest.raises(CorruptMetadataError, match=r"index\.json is damaged \(JSONDecodeError"):
        verify_checkpoint(ck)

    (ck / "index.json").write_text(index_text)
    (ck / "shard-00000-of-00001.safetensors").unlink()
    with pytest.raises(MissingShardFileError, match=r"shard-00000-of-00001\.safetensors"):
        load_checkpoint(ck)
    with pytest.raises(MissingShardFileError, match=r"shard-00000-of-00001\.safetensors"):
        with open_checkpoint(ck) as opened:
            opened.check_all_files()


# ---------------------------------------------------------------------------------------------------------------
# two gloo ranks (started once by the forkserver, from ckpt_qa105_worker.py): each operation of each rank fails in
# turn


def test_two_gloo_ranks_one_failing_operation_fails_every_rank_and_commits_nothing(tmp_path):
    import torch.multiprocessing as mp

    (tmp_path / "runs").mkdir()
    try:
        mp.start_processes(rank_main, args=(2, free_port(), str(tmp_path / "runs"), str(tmp_path)), nprocs=2,
                           join=True, start_method="forkserver")
    finally:
        reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) if (tmp_path / f"rank{r}.pt").exists()
                   else {"error": "no report"} for r in range(2)]
        errors = [f"rank {r}:\n{rep['error']}" for r, rep in enumerate(reports) if "error" in rep]
        assert not errors, "\n".join(errors)
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}:\n{rep['error']}"
    zero, one = reports
    assert len(zero["cases"]) == len(one["cases"]) >= 30
    for c0, c1 in zip(zero["cases"], one["cases"]):
        bad = c0["bad"]
        failed = (c0, c1)[bad]["failed"]
        where = f"rank {bad}'s operation {c0['i']} {failed}: rank 0 {c0['outcome']!r}, rank 1 {c1['outcome']!r}"
        assert failed is not None, where
        # every rank raises, or none: one rank going on alone would wait for the other at its next collective
        assert (c0["outcome"] == "ok") == (c1["outcome"] == "ok"), where
        assert c0["outcome"] != "ok" or failed[0] == "shutil.rmtree(ignore_errors)", where
        assert c0["barriers"] == c1["barriers"], where
        if not c0["committed"]:
            assert c0["found"] == ["step-00000001"] and c0["latest"] == "step-00000001", (where, c0)
        if failed[0] != "shutil.rmtree(ignore_errors)":
            # the rank at fault names the failed path; the others say it was that rank
            own = (c0, c1)[bad]["outcome"]
            assert os.path.basename(failed[1]) in own, where
            if not c0["committed"]:
                assert os.path.basename(failed[1]) in (c0, c1)[1 - bad]["outcome"], where
        assert c0["bit_exact"] and c0["retry_bit_exact"], (where, c0)
        assert c0["after_retry"] == ["latest", "step-00000003"], (where, c0["after_retry"])
