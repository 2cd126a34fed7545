import json

import torch

from moe_train.trainer.loop import Trainer


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_logs_checkpoints_and_resumes_bit_identically(tmp_path, data_dir, make_config):
    # uninterrupted run of 6 steps
    cfg = make_config(tmp_path)
    cfg.data.path = str(data_dir)
    cfg.train.run_dir = str(tmp_path / "full")
    Trainer(cfg).train()
    full_losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "full") if "loss" in r}
    # 3 steps, stop, then a new process-like Trainer resumes to 6
    cfg.train.run_dir = str(tmp_path / "split")
    cfg.train.steps = 3
    Trainer(cfg).train()
    assert (tmp_path / "split" / "checkpoints" / "latest").read_text() == "step-000003"
    cfg.train.steps = 6
    summary = Trainer(cfg).train()
    assert summary["step"] == 6
    split_losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "split") if "loss" in r}
    assert split_losses[6] == full_losses[6] and split_losses[4] == full_losses[4]
    records = read_metrics(tmp_path / "split")
    router = next(r["router"] for r in records if r.get("router"))
    assert set(router["layer1"]) >= {"f", "P", "max_over_mean_load", "dead_experts", "topk_margin"}
    assert any(r.get("event") == "start" and r["resumed_from_step"] == 3 for r in records)
    ckpts = sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step-000003", "step-000006"]


def test_nan_loss_stops_with_a_clear_error(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, max_skipped_steps=2, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    trainer = Trainer(cfg)
    with torch.no_grad():
        trainer.model.lm_head.weight.fill_(float("nan"))
    try:
        trainer.train()
    except RuntimeError as e:
        assert "non-finite for 2 consecutive steps" in str(e)
    else:
        raise AssertionError("a NaN loss must stop the run")
