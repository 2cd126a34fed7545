"""QA 153 (review helper 174): a resume with nothing left to train (the run already at train.steps) ended with
"last_loss": null in its summary and end event, while its eval losses were carried over from the checkpoint. The
last step's training loss is now kept in the checkpoint too, and carried over the same way."""

from __future__ import annotations

import json
import warnings

from moe_train.trainer.loop import Trainer


def test_a_resume_with_nothing_to_train_reports_the_checkpoints_last_loss(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=2, eval_interval=2, save_interval=2, log_interval=1)
    cfg.data.path = str(data_dir)
    first = Trainer(cfg).train()
    assert first["last_loss"] is not None and first["step"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing to train": the point of this run
        again = Trainer(cfg).train()
    assert again["step"] == 2
    assert again["last_loss"] == first["last_loss"], (first, again)
    assert again["last_eval_loss"] == first["last_eval_loss"]
    end = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "end" and end["last_loss"] == first["last_loss"], end
