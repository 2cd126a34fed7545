"""Checks that run the Triton kernels on the CPU through Triton's interpreter. TRITON_INTERPRET must be set
before triton is imported, so a test file runs itself in a subprocess (`verdicts_of(__file__)`), its
`__main__` runs every check (`run_checks`) and prints one verdict per check, and one pytest test per
check asserts its own verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def run_as_script(test_file: str, timeout: float = 900) -> str:
    """test_file run as a script under the interpreter, which must exit 0: its standard output. The limit is 9x
    test_qa79's ~100 s in CI: on a loaded 2-core machine it ran past 300 s (review helper 169), a timeout, not an
    answer."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def verdicts_of(test_file: str) -> dict[str, dict]:
    """{check name: {"verdict": "ok" or the traceback's tail, "seconds": ...}} of test_file run as a script."""
    return json.loads(run_as_script(test_file).strip().splitlines()[-1])


def verdicts_once(test_file: str, shared_dir: Path | None) -> dict[str, dict]:
    """verdicts_of(test_file), run once per session even when pytest-xdist splits the file's tests over workers
    (each worker builds module fixtures for itself, and these scripts are the slowest part of the suite): the first
    worker to ask runs the script and leaves its verdicts in shared_dir, under a lock the other waits on. shared_dir
    None (one process): just verdicts_of."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: each worker runs the script
        shared_dir = None
    if shared_dir is None:
        return verdicts_of(test_file)
    done = shared_dir / f"{Path(test_file).stem}.verdicts.json"
    with open(shared_dir / f"{Path(test_file).stem}.verdicts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return json.loads(done.read_text())
        verdicts = verdicts_of(test_file)  # a failed script raises here, and the next worker to ask runs it again
        partial = done.with_suffix(".partial")
        partial.write_text(json.dumps(verdicts))
        partial.replace(done)
        return verdicts


def run_checks(checks: dict[str, Callable], *args) -> None:
    """The subprocess's main: check(*args) for every check, its verdict printed as one JSON line at the end."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    torch.set_num_threads(2)
    verdicts = {}
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            check(*args)
            verdict = "ok"
        except BaseException:  # noqa: BLE001 - pytest.raises' Failed too: reported per check to the parent test
            verdict = traceback.format_exc()[-2500:]
        verdicts[name] = {"verdict": verdict, "seconds": round(time.perf_counter() - start, 2)}
    print(json.dumps(verdicts))
