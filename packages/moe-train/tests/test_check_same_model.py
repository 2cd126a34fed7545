"""check_same_model compares the network a checkpoint was written for, not how its config spelled it.

Before: a checkpoint saved with head_dim null refused a run that wrote the head_dim it derives to
(d_model // num_heads), and dense_layers [2, 0] refused [0, 2]; both are the same network. A field the
checkpoint's config predates (router.routed_scaling_factor) was not compared at all, so a run with a factor
of 2.5 resumed a checkpoint trained without one.
"""

from __future__ import annotations

import pytest
import torch

from moe_ckpt import ShardSpec, save_checkpoint
from moe_train.config import Config, ConfigError, ModelConfig, RouterConfig
from moe_train.trainer.resume_checks import check_same_model


def config(router: dict | None = None, **model) -> Config:
    fields = {"d_model": 64, "num_heads": 4, "num_layers": 3, "dense_layers": [0, 2], **model}
    return Config(model=ModelConfig(**fields, router=RouterConfig(**(router or {}))))


def checkpoint_of(tmp_path, cfg_dict: dict):
    path = tmp_path / "step-00000001"
    save_checkpoint(path, [ShardSpec("w", (2,), torch.zeros(2))], {"step": 1, "config": cfg_dict})
    return path


@pytest.mark.parametrize(("saved", "run"), [
    (dict(head_dim=None), dict(head_dim=16)),  # 64 // 4
    (dict(head_dim=16), dict(head_dim=None)),
    (dict(dense_layers=[2, 0]), dict(dense_layers=[0, 2])),
    (dict(dense_layers=[0, 2, 2]), dict(dense_layers=[2, 0])),
])
def test_the_same_network_spelled_otherwise_resumes(saved, run, tmp_path):
    path = checkpoint_of(tmp_path, config(**saved).to_dict())
    check_same_model(path, config(**run))


@pytest.mark.parametrize(("saved", "run", "message"), [
    (dict(head_dim=None), dict(head_dim=32), r"model\.head_dim: checkpoint None \(= 16\), this run 32"),
    (dict(head_dim=8), dict(head_dim=None), r"model\.head_dim: checkpoint 8, this run None \(= 16\)"),
    (dict(dense_layers=[2, 0]), dict(dense_layers=[0, 1]), r"model\.dense_layers: checkpoint \[2, 0\] \(= \[0, 2\]\), "
                                                           r"this run \[0, 1\]"),
    (dict(router=dict(routed_scaling_factor=2.5)), dict(),
     r"model\.router\.routed_scaling_factor: checkpoint 2\.5, this run 1\.0"),
])
def test_another_network_is_still_refused_naming_the_field(saved, run, message, tmp_path):
    path = checkpoint_of(tmp_path, config(**saved).to_dict())
    with pytest.raises(ConfigError, match=message):
        check_same_model(path, config(**run))


def test_a_field_the_checkpoint_predates_is_compared_with_its_default(tmp_path):
    """A checkpoint written before router.routed_scaling_factor existed computed with no scaling (1.0). Metadata
    without a model config at all (another writer's) is still not compared."""
    old = config().to_dict()
    del old["model"]["router"]["routed_scaling_factor"]
    path = checkpoint_of(tmp_path / "old", old)
    check_same_model(path, config())
    scaled = config(router=dict(routed_scaling_factor=2.5))
    with pytest.raises(ConfigError, match=r"model\.router\.routed_scaling_factor: checkpoint \(not recorded: "
                                          r"1\.0\), this run 2\.5"):
        check_same_model(path, scaled)
    foreign = checkpoint_of(tmp_path / "foreign", {"data": old["data"]})
    check_same_model(foreign, scaled)
