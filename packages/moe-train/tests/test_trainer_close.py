"""Trainer.close() and `with Trainer(cfg) as trainer:`: a Trainer built and not trained (to evaluate, or restore and
inspect a checkpoint) gives back its run folder's lock, train.threads and its runtime; a Trainer trains once."""

from __future__ import annotations

import pytest
import torch

from moe_train.trainer.errors import TrainingError
from moe_train.trainer.loop import Trainer
from moe_train.trainer.run_lock import RunFolderBusyError


def _cfg(tmp_path, data_dir, make_config, **train):
    cfg = make_config(tmp_path, **{"steps": 2, "eval_interval": 0, "save_interval": 1, **train})
    cfg.data.path = str(data_dir)
    return cfg


def test_a_trainer_built_and_not_trained_holds_the_run_folder_until_close(tmp_path, data_dir, make_config):
    before = torch.get_num_threads()
    cfg = _cfg(tmp_path, data_dir, make_config, threads=1 if before != 1 else 2)
    trainer = Trainer(cfg)
    assert torch.get_num_threads() == cfg.train.threads
    with pytest.raises(RunFolderBusyError):
        Trainer(cfg)  # the first one holds the folder
    assert isinstance(trainer.evaluate(), float)
    trainer.close()
    trainer.close()  # idempotent
    assert torch.get_num_threads() == before
    again = Trainer(cfg)  # the folder is free
    again.close()
    with pytest.raises(TrainingError, match="this Trainer is closed.*build a new Trainer"):
        trainer.train()


def test_with_block_closes_and_a_second_train_is_refused_while_a_new_trainer_resumes(tmp_path, data_dir, make_config):
    cfg = _cfg(tmp_path, data_dir, make_config)
    with Trainer(cfg) as trainer:
        assert trainer.evaluate() > 0
    assert trainer.closed
    Trainer(cfg).close()  # the with block gave the folder back

    first = Trainer(cfg)
    assert first.train()["step"] == 2
    with pytest.raises(TrainingError, match=f"this Trainer is closed.*train.run_dir={str(cfg.train.run_dir)!r}"):
        first.train()  # it ran once already: process groups and the folder's lock are given back
    cfg.train.steps = 3
    assert Trainer(cfg).train()["step"] == 3  # a new Trainer resumes the folder
