"""What a run folder already holds of earlier runs, and when starting over from step 0 would lose it.

A run that starts from step 0 in a folder with a `metrics.jsonl` drops that log's step records (MetricsLog.rewind(-1))
and writes its own: right after a run that died before its first checkpoint, whose steps it trains again. Wrong
when the records are the history of a finished run (the only record of a run that saved nothing), or of the
checkpoints the folder holds (`train.resume=false` with `train.save_interval=0`: the checkpoints stay, the log
that led to them is replaced). Those starts are refused, as a start that would write over a checkpoint is
(checkpoint.check_no_checkpoints_after): move them away, or use another run folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moe_ckpt import step_of
from moe_train.config import ConfigError
from moe_train.trainer.checkpoint import checkpoint_root


@dataclass
class LogHistory:
    """step_records: the records a start from step 0 drops (steps and evals); last_step: the largest step they
    number; completed: some run in the log ended with status "completed"."""

    step_records: int = 0
    last_step: int = 0
    completed: bool = False


def read_log_history(metrics_path: Path) -> LogHistory:
    history = LogHistory()
    if not metrics_path.is_file():
        return history
    with open(metrics_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: the rewind drops it
            if not isinstance(record, dict):
                continue
            if record.get("event") == "end" and record.get("status") == "completed":
                history.completed = True
            elif "event" not in record and isinstance(record.get("step"), int):
                history.step_records += 1
                history.last_step = max(history.last_step, record["step"])
    return history


def check_fresh_start_loses_no_history(run_dir: str | Path, resume: bool) -> None:
    """Refuse a start from step 0 that would drop an earlier run's step records from `run_dir`'s metrics.jsonl when
    they are the log of a completed run or of the checkpoints in the folder."""
    history = read_log_history(Path(run_dir) / "metrics.jsonl")
    if history.step_records == 0:
        return
    why = "train.resume=false" if not resume else "no complete checkpoint to resume from"
    records = f"{history.step_records} step record{'s' if history.step_records != 1 else ''}"
    drop = (f"this run starts from step 0 ({why}) and would drop the {records} (up to step {history.last_step}) "
            "of its metrics.jsonl")
    root = checkpoint_root(run_dir)
    saved = sorted(p.name for p in root.iterdir() if step_of(p) is not None) if root.is_dir() else []
    if saved:
        fix = "resume it (train.resume=true), or move checkpoints/ and metrics.jsonl away, or use a new train.run_dir"
        raise ConfigError(f"train.run_dir={str(run_dir)!r} holds checkpoints of an earlier run ({', '.join(saved)}): "
                          f"{drop}, the log of how they were reached; {fix}")
    if history.completed:
        raise ConfigError(f"train.run_dir={str(run_dir)!r} holds a completed run: {drop}, the only record of it "
                          "(it saved no checkpoint); use a new train.run_dir, or move metrics.jsonl away to start "
                          "over here")
