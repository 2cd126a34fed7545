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
