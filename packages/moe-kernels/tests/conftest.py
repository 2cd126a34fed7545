"""Shared test helpers for moe-kernels."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import interpreter_checks  # noqa: E402


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

    return interpreter_checks.run_as_script


@pytest.fixture(scope="module")
def interpreter_verdicts(request, tmp_path_factory):
    """The verdicts of the requesting test file's interpreter checks: the file run once as a script under
    Triton's CPU interpreter (`interpreter_checks.run_checks` in its `__main__`), once per session under
    pytest-xdist too (the workers share their temporary folder's parent)."""
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    return interpreter_checks.verdicts_once(request.module.__file__, shared)
