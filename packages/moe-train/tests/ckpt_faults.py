"""moe-ckpt's file-system fault injector (its tests/fs_faults.py, one definition) for moe-train's tests, loaded by
path: moe-ckpt's tests are no importable package."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def faults_module():
    path = Path(__file__).parents[2] / "moe-ckpt" / "tests" / "fs_faults.py"
    spec = importlib.util.spec_from_file_location("moe_ckpt_fs_faults", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
