"""train.lr_schedule: the shape of each schedule after warmup, the trainer logging it, and a resume that
changes the schedule saying so."""

import math

import pytest

from moe_train.config import ConfigError, TrainConfig
from moe_train.config_io import build_config
from moe_train.trainer.schedule import lr_at, schedule_change, train_lr_at


def test_each_schedule_after_warmup():
    steps, warm = 12, 2
    lrs = {name: [lr_at(s, 1.0, warm, steps, 0.1, name, 0.25) for s in range(steps + 1)]
           for name in ("cosine", "linear", "constant", "wsd")}
    for name, got in lrs.items():
        assert got[:warm] == [0.5, 1.0], name  # the same warmup everywhere
    assert all(v == 1.0 for v in lrs["constant"][warm:])
    # linear: evenly spaced from the peak at step 2 to 0.1 at step 12 (one past the last)
    assert lrs["linear"][warm:] == pytest.approx([1.0 - 0.9 * i / 10 for i in range(11)])
    assert lrs["cosine"][warm:] == pytest.approx([0.1 + 0.45 * (1 + math.cos(math.pi * i / 10)) for i in range(11)])
    # wsd: held at the peak until the last quarter (3 of 12 steps: from step 9), then a line to 0.1 at 12
    assert lrs["wsd"][warm:10] == [1.0] * 8
    assert lrs["wsd"][9:] == pytest.approx([1.0, 0.7, 0.4, 0.1])


def test_wsd_decay_runs_at_least_one_step_below_the_peak_and_never_inside_the_warmup():
    # 1% of 10 steps rounds to 0: still a decay window of two (the floor is reached at 10, one past the last)
    assert [lr_at(s, 1.0, 0, 10, 0.0, "wsd", 0.01) for s in (7, 8, 9, 10)] == [1.0, 1.0, 0.5, 0.0]
    assert lr_at(0, 1.0, 0, 1, 0.0, "wsd", 0.01) == 1.0  # a one-step run has no room to decay
    # decay fraction 1 with a warmup of 4: the decay starts where the warmup ends, not at step 0
    got = [lr_at(s, 1.0, 4, 8, 0.0, "wsd", 1.0) for s in range(9)]
    assert got[:4] == [0.25, 0.5, 0.75, 1.0] and got[4:] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_config_field_choices_and_the_trainer_helper():
    cfg = build_config("tiny", overrides={"train.lr_schedule": "wsd", "train.lr_decay_fraction": "0.5",
                                          "train.steps": "10", "train.warmup_steps": "0", "train.lr": "1.0"})
    assert [round(train_lr_at(s, cfg.train), 6) for s in range(10)] == [1.0] * 5 + [1.0, 0.82, 0.64, 0.46, 0.28]
    with pytest.raises(ConfigError, match=r"train.lr_schedule.*'step'.*cosine"):
        build_config("tiny", overrides={"train.lr_schedule": "step"})
    with pytest.raises(ConfigError, match=r"train.lr_decay_fraction"):
        build_config("tiny", overrides={"train.lr_decay_fraction": "0"})


def test_resume_under_another_schedule_is_named_and_old_checkpoints_read_as_cosine():
    old = {"lr": 1.0, "warmup_steps": 0, "steps": 10, "min_lr_ratio": 0.1}  # a checkpoint of moe-train <= 0.8
    assert schedule_change(old, TrainConfig(lr=1.0, warmup_steps=0, steps=10, min_lr_ratio=0.1), 5) is None
    msg = schedule_change(old, TrainConfig(lr=1.0, warmup_steps=0, steps=10, min_lr_ratio=0.1, lr_schedule="wsd"), 5)
    assert msg is not None and "train.lr_schedule: cosine -> wsd" in msg
    saved = {**old, "lr_schedule": "wsd", "lr_decay_fraction": 0.2}
    same = TrainConfig(lr=1.0, warmup_steps=0, steps=10, min_lr_ratio=0.1, lr_schedule="wsd")
    assert schedule_change(saved, same, 9) is None
    longer = TrainConfig(lr=1.0, warmup_steps=0, steps=10, min_lr_ratio=0.1, lr_schedule="wsd", lr_decay_fraction=0.5)
    assert "train.lr_decay_fraction: 0.2 -> 0.5" in schedule_change(saved, longer, 6)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_decay_fraction_refused_where_the_schedule_ignores_it(schedule):
    """A decay fraction other than the default with a schedule that does not read it would be
    silently ignored: refused, naming both fields."""
    with pytest.raises(ConfigError, match=r"train.lr_decay_fraction=0.5.*lr_schedule=" + schedule):
        build_config("tiny", overrides={"train.lr_schedule": schedule, "train.lr_decay_fraction": "0.5"})
    assert build_config("tiny", overrides={"train.lr_schedule": schedule}).train.lr_decay_fraction == 0.2
