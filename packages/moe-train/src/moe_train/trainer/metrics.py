"""JSONL metrics log and the per-step numbers the progress bar shows."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from moe_train.data.token_file import naming_the_file


class MetricsLog:
    """Appends one JSON object per line; only rank 0 writes."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` as one line. A last line without its "\n" (a process killed mid-write) is
        dropped first, as rewind drops it: the file stays one JSON object per line."""
        if not self.enabled:
            return
        with naming_the_file(self.path), open(self.path, "ab+") as f:  # a full disk names metrics.jsonl
            _drop_partial_line(f)
            f.write((standard_json(record) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())

    def rewind(self, step: int) -> int:
        """Drop the records of steps after `step` (a run resumed there writes them again); returns how many.

        step=-1: every step record, the step-0 eval too (a run starting afresh writes them all again).
        Events (start, end, async_save) stay: they are the history of the runs. A last line cut
        short by a crash goes too. Rank 0 only; rewritten under a temporary name, then renamed
        (over the file a symlinked metrics.jsonl points to: the link stays)."""
        path = Path(os.path.realpath(self.path))
        if not self.enabled or not path.is_file():
            return 0
        lines = path.read_text().splitlines(keepends=True)
        keep = [line for line in lines if line.endswith("\n") and not _after(line, step)]  # no "\n": died mid-write
        if len(keep) == len(lines):
            return 0
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return len(lines) - len(keep)


def standard_json(record: Any, indent: int | None = None) -> str:
    """record as standard JSON: a non-finite float (the loss or grad norm of a skipped step, NaN router statistics)
    is written as null. Python's json would write NaN / Infinity, which JSON (RFC 8259) does not have and strict
    readers (JavaScript's JSON.parse, say) refuse; a record's "skipped" says why the number is missing."""
    try:
        return json.dumps(record, allow_nan=False, indent=indent)
    except ValueError:
        return json.dumps(_finite_or_none(record), allow_nan=False, indent=indent)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def _drop_partial_line(f: BinaryIO) -> None:
    """Truncate a file opened "ab+" after its last "\n" (to empty if it has none)."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    pos = end
    while pos > 0:
        start = max(0, pos - 65536)
        f.seek(start)
        cut = f.read(pos - start).rfind(b"\n")
        if cut >= 0:
            f.truncate(start + cut + 1)
            return
        pos = start
    f.truncate(0)


def _after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False  # not ours to judge: kept as it is
    return isinstance(record, dict) and "event" not in record and isinstance(record.get("step"), int) \
        and record["step"] > step


def router_health(model: torch.nn.Module,
                  all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, dict]:
    """Per MoE layer: f and P per expert, max/mean load, dead experts, top-k margin, lb / z loss, dropped rows,
    over every training forward since the last call (all micro-batches of the steps since the last record).

    all_reduce_sum: sums a tensor over every rank (Runtime.all_reduce_sum): each rank routes its own tokens, so
    the numbers cover the whole job's tokens, not rank 0's share. One collective; every rank must call this."""
    routers = model.routers()
    if not routers:
        return {}
    parts = [router.take_stats() for _, router in routers]
    stats = torch.cat(parts)
    if all_reduce_sum is not None:
        stats = all_reduce_sum(stats)
    stats = stats.cpu().split([p.numel() for p in parts])  # one device->host copy for every layer
    out: dict[str, dict] = {}
    for (index, router), layer_stats in zip(routers, stats):
        h = router.health(layer_stats)
        if h:
            out[f"layer{index}"] = h
    return out


def max_over_ranks(values: Sequence[float], rank: int, world_size: int,
                   all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> list[float]:
    """The largest of each number over the ranks, in one collective through a sum (each rank fills its own
    slot); every rank must call it with as many values."""
    if world_size == 1:
        return [float(v) for v in values]
    slots = torch.zeros(len(values), world_size, dtype=torch.float64, device=device)
    slots[:, rank] = torch.tensor(values, dtype=torch.float64)
    return all_reduce_sum(slots).max(dim=1).values.tolist()


def peak_memory_gib(device: torch.device) -> float | None:
    """This process's peak allocated memory since it started (None off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None
