"""QA 152 (review helper 171): a file system that refuses a write is the user's machine, not a bug in moe-train, and
gets one line naming the path, as `train` into a read-only run folder did. Before: export-hf, import-hf and
prepare-data into a read-only folder printed a traceback (OSError EROFS from the folder's mkdir); prepare-data on a
full disk printed numpy's "OSError: 213107 requested and 49152 written" (no errno, no file) as a traceback, and a
checkpoint save on a full disk did too. Here: a real file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: each write past
it fails with EFBIG) under prepare-data in a subprocess, and the read-only mount's EROFS raised at export-hf's mkdir."""

from __future__ import annotations

import errno
import pathlib
import resource
import signal
import subprocess
import sys

import pytest

from moe_train.cli import main


def _limit_file_size(limit: int = 200_000) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_prepare_data_past_a_file_size_limit_says_so_in_one_line_and_leaves_no_folder(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(f"word{(i * 7 + j) % 97} tok{j % 13}" for j in range(400))
                                  for i in range(300)))  # ~1.3 MB of text: its token stream is past 200 kB
    out = tmp_path / "data"
    run = subprocess.run([sys.executable, "-m", "moe_train", "prepare-data", str(corpus), "--out", str(out),
                          "--vocab-size", "300"], capture_output=True, text=True, preexec_fn=_limit_file_size)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("moe-train: error:")]
    assert len(lines) == 1 and "prepare-data stopped: [Errno 27] File too large: " in lines[0], run.stderr
    assert f"'{tmp_path / 'data.tmp-'}" in lines[0], lines[0]  # the file it was writing (helper 172: none named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]  # no data folder, no data.tmp-*


def test_export_hf_into_a_read_only_folder_says_so_in_one_line(tmp_path, data_dir, make_config, monkeypatch,
                                                                capsys):
    from moe_train.trainer.loop import Trainer

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    read_only = tmp_path / "ro"
    read_only.mkdir()
    mkdir = pathlib.Path.mkdir

    def refused(self, *args, **kwargs):  # noqa: ANN001, ANN202 - as a read-only mount refuses it
        if read_only in self.parents:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refused)
    assert main(["export-hf", str(tmp_path / "run"), str(read_only / "hf"), "--custom-code"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moe-train: error: export-hf stopped: [Errno 30] Read-only file system: "), err
    assert str(read_only) in err and list(read_only.iterdir()) == []


def test_an_error_of_moe_trains_own_is_still_a_traceback(tmp_path, monkeypatch):
    """Only the file system's refusals are one line: an OSError with another errno (or none) is raised as it was."""
    import moe_train.cli as cli

    def broken(args, rest):  # noqa: ANN001, ANN202
        raise OSError("something moe-train did wrong")

    monkeypatch.setattr(cli, "_run", broken)
    with pytest.raises(OSError, match="something moe-train did wrong"):
        main(["inspect", str(tmp_path)])


def test_train_past_a_file_size_limit_names_the_file_it_was_writing(tmp_path, data_dir):
    """metrics.jsonl's first record is past a 300-byte limit: the one line names it (review helper 172: a write on
    an open file raised an OSError naming no file, "[Errno 27] File too large" alone)."""
    import json

    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    run = subprocess.run([sys.executable, "-m", "moe_train", "train", f"--data.path={data_dir}",
                          f"--train.run_dir={tmp_path / 'run'}", "--preset", "tiny", f"--model.vocab_size={vocab}",
                          "--train.steps=2", "--train.warmup_steps=1", "--train.eval_interval=0",
                          "--train.save_interval=0", "--train.progress=false"],
                         capture_output=True, text=True, preexec_fn=lambda: _limit_file_size(300))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("moe-train: error:")]
    assert len(lines) == 1, run.stderr
    assert f"train stopped: [Errno 27] File too large: '{tmp_path / 'run' / 'metrics.jsonl'}'" in lines[0], lines[0]
