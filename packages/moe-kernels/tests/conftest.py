"""Shared test helpers for moe-kernels."""

import os
import subprocess
import sys

import pytest


def pytest_configure(config):
    """The marks these tests use, registered here too: the package's tests run alone (an sdist, a
    copy in another repository, `--strict-markers`) without the monorepo's pytest config."""
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: multi-process or long tests")


@pytest.fixture
def run_under_interpreter():
    """Run a test file as a script under Triton's CPU interpreter: TRITON_INTERPRET must be set
    before triton is imported, so the interpreter checks run in a fresh process (the file's
    `__main__` block)."""

    def run(path: str, timeout: int = 300) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    return run
