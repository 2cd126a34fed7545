"""The summary's first and last eval losses are the run's, across restarts: a resumed run reported
first_eval_loss None (the step-0 eval happened before the restart), and last_eval_loss None until its first
new eval. They travel in the checkpoint's metadata; a restart that evaluates on another set of windows drops
them (they would not compare with its evals)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_train.trainer.loop import Trainer


def eval_records(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["eval_loss"] for r in map(json.loads, lines) if "eval_loss" in r}


def test_a_resumed_run_reports_the_runs_first_and_last_eval_losses(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=3, eval_interval=3, save_interval=3)
    cfg.data.path = str(data_dir)
    first = Trainer(cfg).train()
    assert first["first_eval_loss"] is not None and first["last_eval_loss"] is not None
    cfg.train.steps = 4  # no eval between the restart and the end: the last one is the checkpoint's
    cfg.train.eval_interval = 5
    resumed = Trainer(cfg).train()
    logged = eval_records(Path(cfg.train.run_dir))
    assert resumed["first_eval_loss"] == pytest.approx(logged[0]) == pytest.approx(first["first_eval_loss"])
    # eval_interval=5 > steps: the run evaluates at its last step (4)
    assert resumed["last_eval_loss"] == pytest.approx(logged[4])


def test_a_restart_without_an_eval_keeps_the_checkpoints_last_one(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=3, eval_interval=3, save_interval=3)
    cfg.data.path = str(data_dir)
    first = Trainer(cfg).train()
    resumed = Trainer(cfg).train()  # already at step 3: nothing to train
    assert (resumed["first_eval_loss"], resumed["last_eval_loss"]) == pytest.approx(
        (first["first_eval_loss"], first["last_eval_loss"]))


def test_a_restart_on_another_eval_set_drops_the_old_losses(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=3, eval_interval=3, save_interval=3, eval_windows=8)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    cfg.train.steps, cfg.train.eval_windows = 4, 4
    with pytest.warns(UserWarning, match="eval losses before and after step 3 are not comparable"):
        resumed = Trainer(cfg).train()
    assert resumed["first_eval_loss"] is None
    assert resumed["last_eval_loss"] == pytest.approx(eval_records(Path(cfg.train.run_dir))[4])
