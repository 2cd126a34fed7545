"""A damaged newest checkpoint (a truncated shard, metadata.json cut short): the resume is refused, never silently
from an older step, and the error names the damaged checkpoint, the newest older one that reads, and how to
resume from it (move the damaged one aside); after that move the run resumes from the older step."""

from __future__ import annotations

import shutil

import pytest

from moe_ckpt import ChecksumMismatchError, CorruptMetadataError, step_dir
from moe_train.trainer.loop import Trainer


@pytest.fixture
def run_with_two_checkpoints(tmp_path, data_dir, make_config):
    """A finished run with checkpoints at steps 2 and 4 (and the config to resume it to step 6)."""
    cfg = make_config(tmp_path, steps=4, save_interval=2, eval_interval=0, log_interval=2, grad_accum=1,
                      keep_last=3)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    cfg.train.steps = 6
    return cfg, tmp_path / "run" / "checkpoints"


def truncate_shard(checkpoint) -> None:
    shard = checkpoint / "shard-00000-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])


def cut_metadata(checkpoint) -> None:
    meta = checkpoint / "metadata.json"
    meta.write_text(meta.read_text()[:40])


@pytest.mark.parametrize(("damage", "error"), [(truncate_shard, ChecksumMismatchError),
                                               (cut_metadata, CorruptMetadataError)])
def test_a_damaged_newest_checkpoint_names_the_newest_intact_one_and_how_to_resume_from_it(
        run_with_two_checkpoints, damage, error):
    cfg, root = run_with_two_checkpoints
    damaged, intact = step_dir(root, 4), step_dir(root, 2)
    damage(damaged)
    with pytest.raises(error) as caught:
        Trainer(cfg).train()
    message = str(caught.value)
    assert str(damaged) in message and intact.name in message, message
    assert f"{damaged.name}.damaged" in message, message  # the move that lets the run resume from step 2
    assert damaged.is_dir(), "the damaged checkpoint is the user's to move: nothing is renamed or deleted"
    shutil.move(damaged, damaged.with_name(f"{damaged.name}.damaged"))
    assert Trainer(cfg).train()["step"] == 6


def test_no_intact_older_checkpoint_is_said_so(run_with_two_checkpoints):
    cfg, root = run_with_two_checkpoints
    truncate_shard(step_dir(root, 4))
    cut_metadata(step_dir(root, 2))
    with pytest.raises(ChecksumMismatchError, match="no older checkpoint") as caught:
        Trainer(cfg).train()
    assert "train.resume=false" in str(caught.value) or "train.run_dir" in str(caught.value)
