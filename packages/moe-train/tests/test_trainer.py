import json

import torch

from moe_ckpt import find_latest, list_checkpoints

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
    assert find_latest(tmp_path / "split" / "checkpoints").name == "step-00000003"
    cfg.train.steps = 6
    summary = Trainer(cfg).train()
    assert summary["step"] == 6
    split_losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "split") if "loss" in r}
    assert split_losses[6] == full_losses[6] and split_losses[4] == full_losses[4]
    records = read_metrics(tmp_path / "split")
    router = next(r["router"] for r in records if r.get("router"))
    assert set(router["layer1"]) >= {"f", "P", "max_over_mean_load", "dead_experts", "topk_margin"}
    assert any(r.get("event") == "start" and r["resumed_from_step"] == 3 for r in records)
    ckpts = [p.name for p in list_checkpoints(tmp_path / "split" / "checkpoints")]
    assert ckpts == ["step-00000003", "step-00000006"]


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


def test_async_save_resumes_like_sync_save(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=3, async_save=True, eval_interval=0)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    cfg.train.steps = 4
    assert Trainer(cfg).train()["step"] == 4
    records = read_metrics(tmp_path / "run")
    assert any(r.get("event") == "async_save" and r["stall_s"] >= 0 for r in records)


def test_resume_into_a_different_model_names_the_tensor_and_shapes(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    cfg.model.expert_hidden = 24
    cfg.train.steps = 2
    try:
        Trainer(cfg).train()
    except Exception as e:  # moe_ckpt.ShapeMismatchError
        assert "experts.w_gate_up" in str(e) and "48" in str(e) and "32" in str(e), str(e)
    else:
        raise AssertionError("resuming into a different model must fail")


def test_tied_embeddings_are_saved_once_and_resume(tmp_path, data_dir, make_config):
    from moe_ckpt import inspect_checkpoint

    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)
    cfg.data.path = str(data_dir)
    cfg.model.tie_embeddings = True
    Trainer(cfg).train()
    names = set(inspect_checkpoint(tmp_path / "run" / "checkpoints")["tensors"])
    assert "embed.weight" in names and "lm_head.weight" not in names
    cfg.train.steps = 3
    trainer = Trainer(cfg)
    assert trainer.train()["step"] == 3
    assert trainer.model.lm_head.weight is trainer.model.embed.weight
