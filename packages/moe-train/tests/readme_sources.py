"""The READMEs the QA 107 checks read (test_qa107_readme_files.py, test_qa107_readme_cli.py): where each is, its text."""

from __future__ import annotations

import functools
from pathlib import Path


ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("moe-kernels", "moe-parallel", "moe-precision", "moe-ckpt", "moe-train")
MODULE = {p: p.replace("-", "_") for p in PACKAGES}
README_NAMES = ("root",) + PACKAGES


def readme_path(name: str) -> Path:
    return ROOT / "README.md" if name == "root" else ROOT / "packages" / name / "README.md"


def readme_dir(name: str) -> Path:
    return readme_path(name).parent


@functools.cache
def readme_text(name: str) -> str:
    return readme_path(name).read_text(encoding="utf-8")
