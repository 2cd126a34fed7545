"""Local checkpoints of the trainer: safetensors for tensors, JSON for the rest, renamed when complete.

Layout of a run folder:  <run_dir>/checkpoints/step-000100/{model.safetensors, optim.safetensors, state.json}
                         <run_dir>/checkpoints/latest  (text: the name of the newest complete checkpoint)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


class CheckpointError(RuntimeError):
    pass


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_local(run_dir: str | Path, step: int, model: dict[str, torch.Tensor], optim: dict[str, torch.Tensor],
               state: dict[str, Any], keep_last: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = root / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in model.items()}, str(tmp / "model.safetensors"))
    save_file({k: v.detach().contiguous().cpu() for k, v in optim.items()}, str(tmp / "optim.safetensors"))
    _write_text_atomic(tmp / "state.json", json.dumps(state, indent=2))
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_text_atomic(root / "latest", name)
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp"))
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_local(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    for f in ("model.safetensors", "optim.safetensors", "state.json"):
        if not (path / f).is_file():
            raise CheckpointError(f"checkpoint {path} is missing {f}")
    return load_file(str(path / "model.safetensors")), load_file(str(path / "optim.safetensors")), json.loads(
        (path / "state.json").read_text()
    )
