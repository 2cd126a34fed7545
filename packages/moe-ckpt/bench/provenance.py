"""The source commit a bench result was made from, for the JSON each script here writes."""

from __future__ import annotations

import subprocess
from pathlib import Path


def source_commit() -> str | None:
    """The git commit of this folder's work tree, "-dirty" when tracked files differ from it; None outside a git
    work tree or without git (a result file then says it cannot name its code, rather than naming the wrong one)."""
    here = str(Path(__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        changed = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if changed.returncode:  # cannot tell whether the tree is clean: no commit rather than a wrong one
        return None
    return head.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")
