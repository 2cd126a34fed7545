"""A step whose loss is non-finite applies no update, even when its gradients are finite, on one process and on
data-parallel ranks where only one rank's loss is non-finite (moe-train <= 0.15.5 applied the update and counted
the step as skipped)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import nonfinite_loss_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402

from moe_train.trainer.loop import Trainer  # noqa: E402
from moe_train.trainer.errors import TrainingError  # noqa: E402


def step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "event" not in r]


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in before if not torch.equal(before[n], after[n])]


def test_an_infinite_loss_with_finite_gradients_applies_no_update(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=3, eval_interval=0, save_interval=0, log_interval=1, max_skipped_steps=3)
    cfg.data.path = str(data_dir)
    trainer = Trainer(cfg)
    w.poison_loss(trainer)
    snapshots = w.record_weights_per_step(trainer)
    summary = trainer.train()
    assert len(snapshots) == 4
    assert changed(snapshots[1], snapshots[2]) == [], "the step with an infinite loss changed the weights"
    assert changed(snapshots[0], snapshots[1]) and changed(snapshots[2], snapshots[3]), "the other steps train"
    assert trainer.skipped_steps == 1 and summary["skipped_steps"] == 1
    counts = {int(s["step"]) for s in trainer.runtime.optimizer.state.values()}
    assert counts == {2}, f"AdamW took {counts} steps, expected 2 of the 3 (the poisoned one is not a step)"
    records = step_records(tmp_path / "run")
    assert [r["skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None  # non-finite: written as null


def test_a_streak_of_infinite_losses_names_the_loss_and_says_no_update_was_made(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=4, eval_interval=0, save_interval=0, log_interval=1, max_skipped_steps=1)
    cfg.data.path = str(data_dir)
    trainer = Trainer(cfg)
    w.poison_loss(trainer)
    with pytest.raises(TrainingError, match=r"loss=inf / aux_loss=[-0-9.e]+ \(no update, no grad norm\) non-finite "
                                            r"for 1 consecutive steps \(step 2\); train.max_skipped_steps=1"):
        trainer.train()


@pytest.mark.parametrize("ep", [1, 2])
def test_one_ranks_infinite_loss_skips_the_step_on_every_rank(tmp_path, data_dir, ep):
    """DP2 (and DP2 x EP2): rank 1's loss is +inf on one step, rank 0's is finite. The summed loss is +inf on both,
    so both drop their gradients (the gradient sync is left ready for the next step) and stay identical."""
    root = tmp_path / "ranks"
    root.mkdir()
    h.start_ranks(h.run_guarded, args=(w.train_two_ranks, str(root), h.free_port(), str(root), str(data_dir), ep),
             nprocs=2)
    results = h.load_results(root, 2)
    for rank, res in enumerate(results):
        snaps = res["snapshots"]
        assert len(snaps) == 4, rank
        assert changed(snaps[1], snaps[2]) == [], f"rank {rank}: the poisoned step changed {changed(snaps[1], snaps[2])}"
        assert changed(snaps[2], snaps[3]), f"rank {rank}: the step after the skipped one did not train"
        assert res["skipped_steps"] == 1 and res["summary"]["skipped_steps"] == 1, rank
    if ep == 1:  # replicated weights stay the same on both ranks
        assert changed(results[0]["snapshots"][3], results[1]["snapshots"][3]) == []
    records = step_records(root / "run")
    assert [r["skipped"] for r in records] == [0.0, 1.0, 0.0]
