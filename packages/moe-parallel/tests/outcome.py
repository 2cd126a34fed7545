"""What a worker reports of a call its test expects to be refused (shared by the multi-rank QA workers)."""

from __future__ import annotations

import time
from collections.abc import Callable


def outcome(fn: Callable[[], object]) -> str:
    """"accepted", or the exception's type and message: the test checks which error was raised, and its text."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks which error, and its message
        return f"{type(e).__name__}: {e}"
    return "accepted"


def timed_outcome(fn: Callable[[], object]) -> dict:
    """outcome(fn) and the seconds it took (a refusal must come before a collective would time out)."""
    start = time.monotonic()
    text = outcome(fn)
    return {"outcome": text, "seconds": time.monotonic() - start}
