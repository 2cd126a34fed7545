"""QA 153 (review helper 174): how a run ends when a signal stops it.
1. A SIGTERM landing inside a backward with activation checkpointing: the run said "stopped by SIGTERM" and wrote its
   end event, then the process died with SIGSEGV at exit (status 139, not 143). The backward's remaining ready tasks
   sat in the main thread's autograd queue until the thread-local cleanup after Python had shut down, where a node
   holding checkpointing's saved-tensor hooks takes the GIL. Here the signal is raised from inside the recompute of
   the second step's backward (deterministic), in a subprocess whose exit status is the check.
2. A second Ctrl-C while the first one's stop was handled (within ~0.2 s) printed a traceback from the CLI's final
   collection; it is one more line now, and the exit status is the signal's.
3. SIGTERM during prepare-data killed it on the spot: no line, and its .tmp folder left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moe_train.cli import main

TESTS = Path(__file__).parent

SIGTERM_IN_BACKWARD = textwrap.dedent("""
    import signal, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_parallel_harness import small_config
    from moe_train.model import transformer
    from moe_train.trainer.loop import Trainer

    calls = {"n": 0}
    norm_forward = transformer.RMSNorm.forward

    def forward(self, x):  # the recompute of the second step's backward raises SIGTERM, as a scheduler would
        if torch._C._current_graph_task_id() != -1:
            calls["n"] += 1
            if calls["n"] == int(sys.argv[5]):
                signal.raise_signal(signal.SIGTERM)
        return norm_forward(self, x)

    transformer.RMSNorm.forward = forward
    if sys.argv[6] == "bench":  # the CLI's bench, which runs its own steps (review helper 175: not covered at first)
        from moe_train.cli import main
        code = main(["bench", "--preset", "tiny", "--steps", "3", "--warmup", "0",
                     f"--train.activation_checkpointing={sys.argv[3]}"])
        print("stopped" if code == 143 else "not stopped", signal.SIGTERM if code == 143 else code, calls["n"],
              flush=True)
        sys.exit(code)
    cfg = small_config(__import__("pathlib").Path(sys.argv[2]), steps=4, eval_interval=0, save_interval=0,
                       activation_checkpointing=sys.argv[3])
    cfg.data.path = sys.argv[4]
    try:
        Trainer(cfg).train()
    except KeyboardInterrupt as e:
        print("stopped", getattr(e, "signum", None), calls["n"], flush=True)
        sys.exit(143)
    print("not stopped", calls["n"], flush=True)
""")


@pytest.mark.parametrize("command,mode,at", [("train", "full", 3), ("train", "mlp", 7), ("bench", "full", 3),
                                             ("bench", "mlp", 3)])
def test_sigterm_inside_a_checkpointed_backward_exits_143_not_sigsegv(tmp_path, data_dir, command, mode, at):
    """at: which norm of the backward's recompute raises it (the crash needs queued tasks holding the hooks)."""
    run = subprocess.run([sys.executable, "-c", SIGTERM_IN_BACKWARD, str(TESTS), str(tmp_path), mode, str(data_dir),
                          str(at), command], capture_output=True, text=True, timeout=300)
    assert run.stdout.split()[:2] == ["stopped", str(int(signal.SIGTERM))], (run.stdout, run.stderr[-2000:])
    assert run.returncode == 143, f"exit status {run.returncode} (-11: SIGSEGV at exit)\n{run.stderr[-2000:]}"


def test_a_second_signal_while_stopping_is_one_more_line_not_a_traceback(monkeypatch, capsys):
    """The first Ctrl-C's stop is reported; a second lands in the final collection (as it did, 0.1 s later)."""
    import moe_train.cli as cli

    def first(cfg, args):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt()

    collect = cli.gc.collect
    monkeypatch.setattr(cli, "_cmd_bench", first)
    monkeypatch.setattr(cli.gc, "collect", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        code = main(["bench", "--preset", "fine-grained-e8", "--steps", "1"])
    except KeyboardInterrupt:  # 0.27.26: out of main(), the traceback (caught here, or pytest would stop the session)
        pytest.fail("a second KeyboardInterrupt left main()")
    finally:
        monkeypatch.setattr(cli.gc, "collect", collect)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "moe-train: stopped by SIGINT (Ctrl-C), again while stopping", err


def test_sigterm_during_prepare_data_says_so_and_leaves_no_tmp_folder(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(f"word{(i * 7 + j) % 997} tok{j % 13}" for j in range(400))
                                  for i in range(3000)))  # ~13 MB: its BPE training takes seconds
    proc = subprocess.Popen([sys.executable, "-m", "moe_train", "prepare-data", str(corpus), "--out",
                             str(tmp_path / "data"), "--vocab-size", "1000"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith("data.tmp-") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "prepare-data ended before its .tmp folder showed"
        time.sleep(0.02)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "moe-train: stopped by SIGTERM" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"], sorted(os.listdir(tmp_path))


@pytest.mark.parametrize("case", ["under a file", "a link to nothing", "under /proc"])
def test_a_run_folder_that_cannot_be_made_is_refused_naming_train_run_dir(tmp_path, data_dir, case, capsys):
    """QA 153 (review helper 174): these named only the path ('[Errno 20] Not a directory: ...'), and a link to
    nothing said '[Errno 17] File exists'; the README says such a folder is refused naming train.run_dir."""
    (tmp_path / "a_file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "run")
    run_dir = {"under a file": tmp_path / "a_file" / "run", "a link to nothing": tmp_path / "dangling",
               "under /proc": Path("/proc/not_a_process_folder/run")}[case]
    why = {"under a file": "a part of the path is a file", "a link to nothing": "a link to nothing, is in the way",
           "under /proc": "a folder of the path cannot be made there"}[case]
    code = main(["train", f"--data.path={data_dir}", "--model.vocab_size=512", f"--train.run_dir={run_dir}",
                 "--train.steps=1", "--train.progress=false"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"moe-train: error: train.run_dir={str(run_dir)!r}: cannot create or write it (" in err, err
    assert why in err and "Traceback" not in err, err
