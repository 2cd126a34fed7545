"""JSONL metrics log and the per-step numbers the progress bar shows."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


class MetricsLog:
    """Appends one JSON object per line; only rank 0 writes."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def rewind(self, step: int) -> int:
        """Drop the records of steps after `step` (a run resumed there writes them again); returns how many.

        Events (start, end, async_save) stay: they are the history of the runs. A last line cut
        short by a crash goes too. Rank 0 only; rewritten under a temporary name, then renamed."""
        if not self.enabled or not self.path.is_file():
            return 0
        lines = self.path.read_text().splitlines(keepends=True)
        keep = [line for line in lines if line.endswith("\n") and not _after(line, step)]  # no "\n": died mid-write
        if len(keep) == len(lines):
            return 0
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return len(lines) - len(keep)


def _after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False  # not ours to judge: kept as it is
    return isinstance(record, dict) and "event" not in record and isinstance(record.get("step"), int) \
        and record["step"] > step


def router_health(model: torch.nn.Module) -> dict[str, dict]:
    """Per MoE layer: f and P per expert, max/mean load, dead experts, top-k margin, lb / z loss."""
    out: dict[str, dict] = {}
    for index, router in model.routers():
        h = router.pop_health()
        if h:
            out[f"layer{index}"] = h
    return out


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None
