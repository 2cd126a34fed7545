"""The README's flow for starting from other weights, through the command line as a user types it: train, export-hf,
import-hf, then train again with `--config OUT/config.json --train.init_from=OUT`. The new run's step-0 eval loss is
the old run's last one (same eval windows, weights carried exactly through an fp32 export), and no warning is
printed about the config file's fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_train.cli import main

SHAPE = ["--model.vocab_size=512", "--model.num_layers=2", "--model.d_model=64", "--model.expert_hidden=32",
         "--data.seq_len=32", "--train.eval_windows=6"]
RUN = ["--train.device=cpu", "--train.progress=false", "--train.micro_batch_size=2", "--train.warmup_steps=1",
       "--train.log_interval=1"]


def evals(run: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


def test_the_readmes_init_from_flow_continues_from_the_imported_weights(tmp_path, data_dir, capsys):
    first = tmp_path / "first"
    assert main(["train", "--preset", "tiny", *SHAPE, *RUN, f"--data.path={data_dir}", f"--train.run_dir={first}",
                 "--train.steps=3", "--train.eval_interval=3", "--train.save_interval=3"]) == 0
    assert main(["export-hf", str(first), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    again = tmp_path / "again"
    assert main(["train", "--config", str(tmp_path / "imported" / "config.json"), *RUN, "--data.seq_len=32",
                 "--train.eval_windows=6", f"--data.path={data_dir}", f"--train.run_dir={again}",
                 f"--train.init_from={tmp_path / 'imported'}", "--train.steps=1", "--train.eval_interval=1"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err, err
    assert evals(again)[0] == pytest.approx(evals(first)[3], rel=1e-6, abs=0), (evals(first), evals(again))
    start = json.loads((again / "metrics.jsonl").read_text().splitlines()[0])
    assert start["init_from"] == str(tmp_path / "imported")
