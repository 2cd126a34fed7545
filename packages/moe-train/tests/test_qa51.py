"""QA 51: `moe-train train` journeys from the command line: a run folder the run cannot write in (found before the
first step, one line), and the steps a run stopped by non-finite losses names."""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from moe_train.cli import main

PR_CAPBSET_DROP = 24  # linux/prctl.h


def _train_args(data: Path, run_dir: Path, *more: str, save_interval: int = 2) -> list[str]:
    """A run of a few steps of a small model on `data`, saving every save_interval steps."""
    return ["train", f"--data.path={data}", "--model.vocab_size=300", "--model.d_model=32", "--model.num_layers=2",
            "--model.num_heads=4", "--model.num_kv_heads=2", "--model.num_experts=4", "--model.expert_hidden=16",
            "--data.seq_len=8", "--train.micro_batch_size=1", "--train.warmup_steps=1", "--train.eval_interval=0",
            "--train.steps=4", f"--train.save_interval={save_interval}", f"--train.run_dir={run_dir}", "--train.progress=false", *more]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A folder with a small data folder (a train split of some 60 tokens, vocab < 300)."""
    from moe_train.data import prepare_data

    folder = tmp_path_factory.mktemp("qa51")
    docs = [f"doc {i} hello world foo bar baz qux\n" for i in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the corpus gives fewer than 300 tokens
        prepare_data(docs, folder / "data", vocab_size=300, source="test")
    return folder


def _one_error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_checkpoints_path_that_is_a_file_is_refused_before_the_first_step(shared, tmp_path, capsys):
    """The run trained up to its first save and only then failed (NotADirectoryError on step-00000002.tmp), the
    steps since the start lost; now it is refused before the start event, naming the folder."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a folder\n")
    line = _one_error_line(capsys, _train_args(shared / "data", run))
    assert line.startswith(f"moe-train: error: train.run_dir={str(run)!r}: {run / 'checkpoints'} is a file"), line
    assert not (run / "metrics.jsonl").exists(), (run / "metrics.jsonl").read_text()  # nothing trained, nothing logged
    # the same folder trains when the run saves nothing
    assert main(_train_args(shared / "data", run, save_interval=0)) == 0
    assert (run / "checkpoints").read_text() == "not a folder\n"


def test_a_checkpoints_link_to_nothing_is_refused_before_the_first_step(shared, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(tmp_path / "gone")
    line = _one_error_line(capsys, _train_args(shared / "data", run))
    assert f"cannot make a folder in {run / 'checkpoints'} (No such file or directory)" in line, line
    assert not (run / "metrics.jsonl").exists()


def _without_root_overrides():
    """preexec_fn: root's child loses CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (from its bounding set, so the exec
    keeps neither), and the permission bits of its own folders apply to it as to any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _unwritable(tmp_path: Path, case: str) -> Path:
    """A run folder this job cannot use in the way `case` says."""
    run = tmp_path / "run"
    if case == "checkpoints":  # another user's checkpoints/ (or a read-only one)
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints").chmod(0o555)
    elif case == "parent":  # a run folder to create in a folder this job may not write
        tmp_path.chmod(0o555)
    else:  # a metrics.jsonl left read-only
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
        (run / "metrics.jsonl").chmod(0o444)
    return run


@pytest.mark.parametrize("case,named", [
    ("checkpoints", "cannot make a folder in {run}/checkpoints (Permission denied)"),
    ("parent", "cannot create or write it (Permission denied: {run}"),
    ("metrics", "cannot write {run}/metrics.jsonl (Permission denied)"),
])
def test_a_run_folder_this_job_cannot_write_exits_2_with_one_line_before_the_first_step(shared, tmp_path, case,
                                                                                        named):
    """The CLI where the folder is not writable for it: the first save raised PermissionError (a traceback, the
    steps since the start lost); a run folder it could not create, or a read-only metrics.jsonl, a traceback
    before the start. Now: exit 2, one line naming train.run_dir and what cannot be written, nothing trained."""
    (tmp_path / "t").mkdir()
    run = _unwritable(tmp_path / "t", case)
    try:
        proc = subprocess.run([sys.executable, "-m", "moe_train", *_train_args(shared / "data", run)],
                              capture_output=True, text=True, timeout=180,
                              preexec_fn=_without_root_overrides if os.geteuid() == 0 else None)
    finally:
        (tmp_path / "t").chmod(0o755)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith(f"moe-train: error: train.run_dir={str(run)!r}: "), lines
    assert named.format(run=run) in lines[0], lines
    records = (run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").exists() else ""
    assert records == "", records  # no start event, no step trained


def test_a_run_stopped_by_non_finite_losses_names_the_steps_of_the_streak(shared, tmp_path, capsys):
    """Every step is non-finite (weights of 1e38 overflow the first forward): the run stops at its second step.
    The error said `(step 1)`, the count of steps done, not the step that failed; metrics.jsonl numbers the steps
    from 1, so the streak is steps 1 to 2."""
    run = tmp_path / "run"
    argv = _train_args(shared / "data", run, "--model.init_std=1e38", "--train.max_skipped_steps=2",
                       "--train.log_interval=1")
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "non-finite for 2 consecutive steps (steps 1 to 2)" in lines[0], lines
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the step that stopped the run is logged too (moe-train 0.27.23; it raised before its record, review helper 160),
    # and the end event counts it
    assert [r["step"] for r in records if r.get("skipped") == 1.0] == [1, 2], records
    assert records[-1]["event"] == "end" and records[-1]["step"] == 2 and records[-1]["skipped_steps"] == 2, records
    # a streak of one names one step
    argv = _train_args(shared / "data", tmp_path / "run2", "--model.init_std=1e38", "--train.max_skipped_steps=1")
    assert main(argv) == 1
    assert "non-finite for 1 consecutive steps (step 1);" in capsys.readouterr().err


def _default_stop_signals() -> None:
    """preexec_fn: the child starts with SIGINT / SIGTERM at their defaults. A job started in the background by a
    non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python then installs no Ctrl-C handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_stopped_by_a_signal_prints_one_line_and_exits_with_the_signals_code(shared, tmp_path, signum):
    """SIGTERM (torchrun stopping the other ranks, a scheduler) or Ctrl-C in the middle of a run: every rank printed
    a KeyboardInterrupt traceback, and a SIGTERM'd job exited as if Ctrl-C had killed it. Now one line, and the
    shell's code for that signal (143 / 130); the end event and the resume are as before."""
    run = tmp_path / "run"
    args = _train_args(shared / "data", run, save_interval=1)
    args[args.index("--train.steps=4")] = "--train.steps=100000"
    proc = subprocess.Popen([sys.executable, "-m", "moe_train", *args], stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_stop_signals)
    try:
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob("step-*")) and time.monotonic() < deadline:  # training is on
            time.sleep(0.2)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert proc.returncode == 128 + signum, (proc.returncode, err[-3000:])
    want = "SIGTERM: the job was told to stop" if signum == signal.SIGTERM else "SIGINT (Ctrl-C)"
    assert lines[0].startswith(f"moe-train: stopped by {want}"), lines
    end = json.loads((run / "metrics.jsonl").read_text().strip().splitlines()[-1])
    assert end["event"] == "end" and end["status"] == "interrupted", end


def test_a_resume_with_nothing_left_to_train_says_so(shared, tmp_path, capsys):
    """A run already at train.steps, started again, exited 0 with a summary of null losses and, with the progress
    bar off, not a word about why."""
    run = tmp_path / "run"
    args = _train_args(shared / "data", run)
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "train.steps=4: the run is already at step 4" in err and "nothing to train" in err, err
