"""QA pass 34: a resume whose checkpoint is past train.steps, skipped steps in metrics.jsonl and the expert bias,
the message of a layout that does not fit the world size."""

from __future__ import annotations

import json

import pytest
import torch

from moe_train.cli import main
from moe_train.config import ConfigError
from moe_train.trainer.loop import Trainer
from metadata_edit import rewrite_metadata  # noqa: E402


def _strict_records(path):
    """Every line of metrics.jsonl as standard JSON (NaN / Infinity refused, as JavaScript's JSON.parse refuses them)."""
    def refuse(constant):
        raise ValueError(f"not standard JSON: {constant}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_resume_from_a_checkpoint_past_train_steps_is_refused_naming_both(tmp_path, data_dir, make_config):
    Trainer(make_config(tmp_path, steps=6, eval_interval=0, save_interval=3)).train()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"train\.steps=4: .*checkpoint at step 6.*expected train\.steps >= 6"):
        Trainer(make_config(tmp_path, steps=4, eval_interval=0, save_interval=3)).train()
    # refused before anything was logged; the same steps (a finished run run again) still does nothing quietly
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    assert Trainer(make_config(tmp_path, steps=6, eval_interval=0, save_interval=3)).train()["step"] == 6


def test_a_skipped_step_is_logged_as_standard_json_and_leaves_the_expert_bias(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=4, eval_interval=0, save_interval=0, log_interval=1, max_skipped_steps=3)
    trainer = Trainer(cfg)
    routers = [r for _, r in trainer.model.routers()]
    assert routers and all(r.cfg.expert_bias for r in routers)
    step, seen = trainer._train_step, {}

    def poisoned_at_step_2():
        if trainer.step != 1:
            return step()
        seen["bias"] = [r.expert_bias.clone() for r in routers]
        with torch.no_grad():
            trainer.model.embed.weight[:, 0] = float("nan")  # NaN activations: the router's load is garbage
        out = step()
        seen["bias_after"] = [r.expert_bias.clone() for r in routers]
        seen["step_load"] = [r.step_load.clone() for r in routers]
        with torch.no_grad():
            trainer.model.embed.weight[:, 0] = 0.0
        return out

    trainer._train_step = poisoned_at_step_2
    assert trainer.train()["skipped_steps"] == 1
    for before, after, load in zip(seen["bias"], seen["bias_after"], seen["step_load"]):
        assert torch.equal(before, after)  # a skipped step moves neither the weights nor the bias
        assert not load.any()  # and its load does not leak into the next step's
    records = _strict_records(tmp_path / "run" / "metrics.jsonl")
    skipped = next(r for r in records if r.get("step") == 2 and "loss" in r)
    assert skipped["skipped"] == 1.0 and skipped["loss"] is None and skipped["grad_norm"] is None
    assert isinstance(next(r for r in records if r.get("step") == 3 and "loss" in r)["loss"], float)


def test_a_layout_larger_than_the_world_says_parallel_layout_once(capsys, data_dir, tmp_path):
    rc = main(["train", f"--data.path={data_dir}", "--model.vocab_size=512", "--parallel.dp=2",
               f"--train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("parallel layout:") == 1, err
    assert "parallel.dp=2 x parallel.pp=1 = 2 does not equal world_size=1" in err


def test_standard_json_writes_non_finite_numbers_as_null():
    """What train prints, bench prints and writes, and metrics.jsonl holds, all go through it."""
    from moe_train.trainer.metrics import standard_json

    text = standard_json({"last_loss": float("nan"), "x": [1.5, float("inf")], "d": {"y": -float("inf"), "n": 2}})
    assert json.loads(text) == {"last_loss": None, "x": [1.5, None], "d": {"y": None, "n": 2}}
    assert json.loads(standard_json({"a": 1.0}, indent=2)) == {"a": 1.0}


def test_bench_closes_its_runtime_when_a_step_raises(monkeypatch):
    """A failing step (here: a RuntimeError from the step itself) still closes the runtime it made
    (its process group, under torchrun), and the error reaches the caller."""
    import moe_train.bench as bench
    from moe_train.config_io import build_config

    real, closed = bench.synthetic_steps, []

    def failing_steps(cfg):
        runtime, _ = real(cfg)
        close = runtime.close
        monkeypatch.setattr(runtime, "close", lambda: (closed.append(True), close())[1])

        def one_step(i):
            raise RuntimeError("step failed")
        return runtime, one_step

    monkeypatch.setattr(bench, "synthetic_steps", failing_steps)
    cfg = build_config("tiny", overrides={"model.num_layers": "1", "data.seq_len": "16", "train.micro_batch_size": "1"})
    with pytest.raises(RuntimeError, match="step failed"):
        bench.run_bench(cfg, steps=1, warmup=1)
    assert closed == [True]


@pytest.mark.parametrize("edit,named", [
    (lambda m: m.pop("sampler"), "sampler=None, expected an object"),
    (lambda m: m.update(step="6"), "step='6', expected an integer >= 0"),
    (lambda m: m["layout"].pop("world_size"), "layout.world_size=None, expected a positive integer"),
])
def test_a_resume_from_edited_metadata_names_the_field_before_loading(tmp_path, data_dir, make_config, edit, named):
    """metadata.json that is valid JSON but lacks (or mistypes) a field the trainer's resume reads is refused
    naming the file and field, before any tensor is read (it was a bare KeyError half-way through restoring)."""
    from moe_ckpt import CorruptMetadataError

    Trainer(make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)).train()
    meta_path = next((tmp_path / "run" / "checkpoints").glob("step-*")) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    rewrite_metadata(meta_path, meta)
    with pytest.raises(CorruptMetadataError, match=r"metadata\.json: " + named.replace("(", r"\(").replace(")", r"\)")):
        Trainer(make_config(tmp_path, steps=4, eval_interval=0, save_interval=2)).train()


def poisoned(trainer, bad_steps):
    """The trainer, with the steps in bad_steps computed on a NaN embedding column (skipped as non-finite)."""
    step = trainer._train_step

    def run():
        if trainer.step + 1 not in bad_steps:
            return step()
        with torch.no_grad():
            saved = trainer.model.embed.weight[:, 0].clone()
            trainer.model.embed.weight[:, 0] = float("nan")
        try:
            return step()
        finally:
            with torch.no_grad():
                trainer.model.embed.weight[:, 0] = saved
    trainer._train_step = run
    return trainer


def test_a_streak_of_skipped_steps_goes_on_across_a_resume(tmp_path, data_dir, make_config):
    """train.max_skipped_steps counts consecutive non-finite steps; a run saved in the middle of a streak and
    resumed (a job restarted by its scheduler) stops where the unbroken run would have, not N steps later."""
    from moe_train.trainer.errors import TrainingError

    first = poisoned(Trainer(make_config(tmp_path, steps=3, eval_interval=0, save_interval=3, max_skipped_steps=3)), {2, 3})
    assert first.train()["skipped_steps"] == 2
    second = poisoned(Trainer(make_config(tmp_path, steps=5, eval_interval=0, save_interval=3, max_skipped_steps=3)), {4})
    with pytest.raises(TrainingError, match="non-finite for 3 consecutive steps"):
        second.train()


def test_a_save_in_a_streak_of_skipped_steps_keeps_the_checkpoints_before_it(tmp_path, data_dir, make_config):
    """With keep_last=1, the save at step 4 (steps 3 and 4 skipped as non-finite) deleted step 2's checkpoint: if
    step 2's update is what broke the run, every resume then starts from the broken state. Retention waits for
    a save outside a streak (found by helper 51)."""
    poisoned(Trainer(make_config(tmp_path, steps=4, eval_interval=0, save_interval=2, keep_last=1,
                                 max_skipped_steps=5)), {3, 4}).train()
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000004"]
    Trainer(make_config(tmp_path, steps=6, eval_interval=0, save_interval=2, keep_last=1)).train()
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000006"]  # a good save prunes again
