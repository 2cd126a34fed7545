"""QA 151 (review helper 164's mutation audit of moe-train): the training loop. Each test fails on the mutant it names
and passes on the code: the loss not divided by grad_accum (L1: grad_norm and clipping grow with it); isolated
skipped steps counted as a streak (L6); the expert bias moved on a skipped step (L7); retention pruning good
checkpoints during a streak of skips (L15); the streak error naming the wrong first step (B9); the last step not
logged or saved when train.steps is off the intervals (L12, L14); FSDP clipping to 0 with grad_clip=0 (D2)."""

from __future__ import annotations

import json

import torch
from moe_ckpt import find_latest
from moe_train.trainer.loop import Trainer
from moe_train.trainer.runtime import LocalRuntime, StepResult

# grad_accum=2 x micro_batch_size=2 draws the same 4 windows as grad_accum=1 x micro_batch_size=4: the step's
# gradient (so its reported grad_norm, and what train.grad_clip clips) must be the mean over them, not a sum that
# grows with grad_accum.


def _first_grad_norm(tmp_path, data_dir, make_config, name, micro, accum):
    cfg = make_config(tmp_path, steps=1, micro_batch_size=micro, grad_accum=accum, eval_interval=0,
                      save_interval=0, log_interval=1, run_dir=str(tmp_path / name))
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in recs if "grad_norm" in r)["grad_norm"]


def test_grad_norm_does_not_scale_with_grad_accum(tmp_path, data_dir, make_config):
    one = _first_grad_norm(tmp_path, data_dir, make_config, "a1", micro=4, accum=1)
    two = _first_grad_norm(tmp_path, data_dir, make_config, "a2", micro=2, accum=2)
    assert 0.8 < two / one < 1.25, (one, two)


# A step the runtime reports as skipped (non-finite gradients) must neither move the routers' expert bias nor
# count towards train.max_skipped_steps once a good step has followed it.


class SkipSteps(LocalRuntime):
    """LocalRuntime whose optimizer steps number `skip` (1-based) come back skipped, as with a non-finite grad norm."""

    skip: set[int] = set()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def step(self, lr):
        self.calls += 1
        if self.calls in self.skip:
            self.discard_gradients()
            return StepResult(grad_norm=float("nan"), skipped=True)
        return super().step(lr)


def _trainer(tmp_path, data_dir, make_config, skip, **train):
    cfg = make_config(tmp_path, eval_interval=0, save_interval=0, **train)
    cfg.data.path = str(data_dir)
    rt = type("R", (SkipSteps,), {"skip": set(skip)})(cfg, torch.device("cpu"))
    return Trainer(cfg, runtime=rt)


def test_isolated_skips_do_not_add_up_to_a_streak(tmp_path, data_dir, make_config):
    # steps 1 and 3 skipped, 2 and 4 fine: never 2 consecutive skips
    trainer = _trainer(tmp_path, data_dir, make_config, {1, 3}, steps=4, max_skipped_steps=2)
    summary = trainer.train()
    assert summary["step"] == 4 and summary["skipped_steps"] == 2


def test_a_skipped_step_leaves_the_expert_bias_as_it_was(tmp_path, data_dir, make_config):
    trainer = _trainer(tmp_path, data_dir, make_config, {1}, steps=1, max_skipped_steps=5)
    routers = [r for _, r in trainer.model.routers()]
    assert routers and all(r.cfg.expert_bias for r in routers)
    before = [r.expert_bias.clone() for r in routers]
    trainer.train()
    assert all(torch.equal(b, r.expert_bias) for b, r in zip(before, routers))


def test_a_streak_of_skipped_steps_prunes_no_checkpoint(tmp_path, data_dir, make_config):
    from moe_ckpt import list_checkpoints

    trainer = _trainer(tmp_path, data_dir, make_config, {2, 3}, steps=3, max_skipped_steps=5)
    trainer.cfg.train.save_interval, trainer.cfg.train.keep_last = 1, 1
    trainer.train()
    names = [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step-00000001", "step-00000002", "step-00000003"]


def test_the_streak_error_names_its_steps(tmp_path, data_dir, make_config):
    import pytest
    from moe_train.trainer.errors import TrainingError

    trainer = _trainer(tmp_path, data_dir, make_config, {2, 3}, steps=4, max_skipped_steps=2)
    with pytest.raises(TrainingError, match=r"for 2 consecutive steps \(steps 2 to 3\)"):
        trainer.train()


# The last step of a run is logged and saved whatever train.log_interval / train.save_interval are.


def test_the_last_step_is_logged_and_saved_off_the_intervals(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=5, log_interval=2, save_interval=3, eval_interval=0)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [2, 4, 5]
    assert find_latest(tmp_path / "run" / "checkpoints").name == "step-00000005"


# parallel.strategy=fsdp: train.grad_clip=0 disables clipping (as in the ddp runtimes), it does not clip to 0.


def _losses(tmp_path, data_dir, make_config, name, clip):
    cfg = make_config(tmp_path, steps=2, log_interval=1, eval_interval=0, save_interval=0, grad_clip=clip,
                      run_dir=str(tmp_path / name))
    cfg.data.path = str(data_dir)
    cfg.parallel.strategy = "fsdp"
    Trainer(cfg).train()
    recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


def test_grad_clip_zero_is_no_clipping(tmp_path, data_dir, make_config):
    off = _losses(tmp_path, data_dir, make_config, "off", 0.0)
    huge = _losses(tmp_path, data_dir, make_config, "huge", 1e30)
    assert off[0] == huge[0]
    assert abs(off[1] - huge[1]) < 1e-4, (off, huge)
