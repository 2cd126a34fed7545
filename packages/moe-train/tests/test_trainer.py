import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from moe_ckpt import find_latest, list_checkpoints

from moe_train.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import free_port  # noqa: E402


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


def test_nan_loss_stops_with_a_clear_error_and_an_end_event_saying_why(tmp_path, data_dir, make_config):
    from moe_train.trainer.errors import TrainingError

    cfg = make_config(tmp_path, max_skipped_steps=2, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    trainer = Trainer(cfg)
    with torch.no_grad():
        trainer.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(TrainingError, match="non-finite for 2 consecutive steps"):
        trainer.train()
    end = read_metrics(tmp_path / "run")[-1]
    assert end["event"] == "end" and end["status"] == "failed" and end["skipped_steps"] == 2
    # the step that stopped the run is counted and logged (moe-train 0.27.23: it raised before it was, so the end
    # event said step 1 of a streak the error called steps 1 to 2)
    assert end["step"] == 2 and [r["step"] for r in read_metrics(tmp_path / "run") if r.get("skipped")] == [2]
    assert "TrainingError: loss=nan" in end["error"] and "train.max_skipped_steps=2" in end["error"]


def test_async_save_resumes_like_sync_save(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=3, async_save=True, eval_interval=0)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    cfg.train.steps = 4
    assert Trainer(cfg).train()["step"] == 4
    records = read_metrics(tmp_path / "run")
    assert any(r.get("event") == "async_save" and r["stall_s"] >= 0 for r in records)


def test_resume_into_a_different_model_names_the_fields(tmp_path, data_dir, make_config):
    """Another model is refused before anything loads, also when every tensor shape still fits
    (fewer layers, tied embeddings): those would load silently into a different network."""
    from moe_train.config import ConfigError

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    cfg.train.steps = 2
    for field, value in (("expert_hidden", 24), ("num_layers", cfg.model.num_layers - 1),
                         ("tie_embeddings", not cfg.model.tie_embeddings)):
        changed = copy.deepcopy(cfg)
        before = getattr(cfg.model, field)
        setattr(changed.model, field, value)
        with pytest.raises(ConfigError, match=rf"model.{field}: checkpoint {before!r}, this run {value!r}"):
            Trainer(changed).train()
    tuned = copy.deepcopy(cfg)  # kernels and loss weights are not the network: resuming with them changed is fine
    tuned.model.gemm_backend = "reference"
    tuned.model.router.lb_loss_weight = 0.02
    assert Trainer(tuned).train()["step"] == 2


def test_checkpoints_past_the_start_step_are_refused_before_training(tmp_path, data_dir, make_config):
    """--no-resume on a run with checkpoints, or a stray step folder past the resume point, would
    train up to it and then fail to save over it: refused at the start instead."""
    from moe_train.config import ConfigError

    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    fresh = copy.deepcopy(cfg)
    fresh.train.resume = False
    with pytest.raises(ConfigError, match=r"step-00000001 exists but this run starts from step 0 \(no resume\)"):
        Trainer(fresh).train()
    fresh.train.save_interval = 0  # it writes over no checkpoint, but would replace the log that led to them
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(step-00000001, step-00000002\)"):
        Trainer(fresh).train()
    (Path(cfg.train.run_dir) / "checkpoints" / "step-00000003").mkdir()  # incomplete: no index.json
    cfg.train.steps = 4
    with pytest.raises(ConfigError, match=r"step-00000003 exists but this run resumes from step 2"):
        Trainer(cfg).train()


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


def test_training_in_an_import_hf_folder_is_refused(tmp_path, data_dir, make_config):
    """An import-hf output is no run folder: a run there would begin from a random init beside the imported weights.
    The refusal names train.init_from, which starts a run from them (tests/test_init_from.py)."""
    from moe_train.config import ConfigError

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    run = Path(cfg.train.run_dir)
    run.mkdir(parents=True)
    (run / "model.safetensors").write_bytes(b"")
    (run / "hf_extra.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds an import-hf output .*use train.init_from="):
        Trainer(cfg).train()


def test_an_eval_split_shorter_than_one_window_is_a_data_error(tmp_path, data_dir, make_config):
    """It used to report eval loss 0.0 (an empty list of eval batches)."""
    from moe_train.data import DataError

    cfg = make_config(tmp_path, steps=1, eval_interval=1, save_interval=0)
    cfg.data.path = str(data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    cfg.data.seq_len = meta["splits"]["eval"]["num_tokens"]  # one token short of a window
    with pytest.raises(DataError, match="the eval split has .* fewer than one window"):
        Trainer(cfg).train()


def test_eval_loss_does_not_depend_on_the_micro_batch_size(tmp_path, data_dir, make_config):
    """The eval set is train.eval_windows sequences, batched evenly: the same windows and the same
    mean loss for any micro-batch size (and so any parallel layout), up to float summation order."""
    losses = []
    for mbs in (1, 3, 4, 8):
        cfg = make_config(tmp_path / f"m{mbs}", micro_batch_size=mbs, eval_windows=12)
        cfg.data.path = str(data_dir)
        torch.manual_seed(0)
        trainer = Trainer(cfg)
        assert sum(x.shape[0] for x, _ in trainer.eval_data) == 12
        losses.append(trainer.evaluate())
    assert max(losses) - min(losses) < 1e-5 * abs(losses[0]), losses


@pytest.mark.parametrize("fails_at", ["data, before the model", "run_dir, after the model"])
def test_a_trainer_that_fails_to_construct_destroys_the_process_group_it_made(
        fails_at, tmp_path, data_dir, make_config, monkeypatch):
    """A later config or data error must not leave the gloo group (and its threads) behind: the next
    make_runtime in this process would join it instead of making its own."""
    import torch.distributed as dist

    from moe_train.config import ConfigError
    from moe_train.data import DataError

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=0, device="cpu")
    cfg.data.path = str(data_dir)
    cfg.parallel.expert_capacity_factor = 4.0  # not the plain one-process setup: a DistributedRuntime, world of 1
    if fails_at.startswith("data"):
        cfg.data.path, error = str(tmp_path / "missing"), DataError
    else:
        (tmp_path / "a_file").write_text("")
        cfg.train.run_dir, error = str(tmp_path / "a_file" / "run"), ConfigError  # NotADirectoryError before 0.27.27
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert not dist.is_initialized()
    try:
        with pytest.raises(error):
            Trainer(cfg)
        assert not dist.is_initialized(), f"Trainer failed at {fails_at} and left the process group initialised"
    finally:
        if dist.is_initialized():  # keep the other tests of this process clean when the check fails
            dist.destroy_process_group()
