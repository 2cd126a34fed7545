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


def run_as_script(test_file: str, timeout: float = 300) -> str:
    """test_file run as a script under the interpreter, which must exit 0: its standard output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def verdicts_of(test_file: str) -> dict[str, dict]:
    """{check name: {"verdict": "ok" or the traceback's tail, "seconds": ...}} of test_file run as a script."""
    return json.loads(run_as_script(test_file).strip().splitlines()[-1])


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
