"""QA 45: the multi-process pretraining journey through moe-train (layouts, resume, export, a killed rank)."""

import pytest

from moe_train.config import ConfigError
from moe_train.trainer.loop import Trainer


def test_an_fsdp_run_in_a_folder_with_a_checkpoint_is_refused_before_anything_is_logged(data_dir, tmp_path,
                                                                                        make_config):
    """`--parallel.strategy=fsdp` (which must set train.save_interval=0) with the default train.resume in a run
    folder that holds a checkpoint: every rank built its runtime, logged a start event, then died in the load with
    `NotImplementedError: checkpoint_shards needs strategy='ddp'` and a traceback, the metrics a `failed` run."""
    Trainer(make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)).train()
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_text()
    cfg = make_config(tmp_path, steps=4, eval_interval=0, save_interval=0)
    cfg.parallel.strategy = "fsdp"
    with pytest.raises(ConfigError, match=r"parallel.strategy='fsdp': expected 'ddp' to resume .* from step-00000002"):
        Trainer(cfg).train()
    assert metrics.read_text() == before
