"""train.init_from: a run that starts at step 0 takes its weights from a run folder, a checkpoint folder (any
layout wrote it) or an import-hf output; optimizer state, step and data order start fresh; a resumed run never reads
it again; a source of another model, a missing one, or one holding NaN is refused naming train.init_from; another
rope_theta or other windows are taken with a warning."""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import init_from_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402

from moe_train.config import ConfigError  # noqa: E402
from moe_train.hf_bridge import export_hf, import_hf  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def source(tmp_path, data_dir):
    """A run of 3 steps (one checkpoint at step 3) and its final weights."""
    trainer = Trainer(w.config(tmp_path / "src", str(data_dir), None, steps=3))
    trainer.train()
    return tmp_path / "src", state_of(trainer.model)


def check_starts_from(run: Trainer, seen: dict, weights: dict[str, torch.Tensor]) -> None:
    for name, (_, _, t) in seen["shards"].items():
        if name.startswith("optim."):
            if name.endswith(".master"):
                assert torch.equal(t, weights[name[len("optim."):-len(".master")]]), name
            else:
                assert not t.any(), f"{name}: expected fresh optimizer state"
        else:
            assert torch.equal(t, weights[name]), name
    for name, b in seen["buffers"].items():
        assert torch.equal(b, weights[name]), name
    assert any(b.any() for b in seen["buffers"].values()), "the source's expert bias is not zero: a real check"


@pytest.mark.parametrize("which", ["run folder", "checkpoint folder"])
def test_a_run_starts_from_the_weights_of_another_run(which, source, tmp_path, data_dir):
    src, weights = source
    given = src if which == "run folder" else src / "checkpoints" / "step-00000003"
    trainer = Trainer(w.config(tmp_path / "b", str(data_dir), str(given)))
    seen = w.before_first_step(trainer)
    summary = trainer.train()
    check_starts_from(trainer, seen, weights)
    assert summary["step"] == 2 and trainer.step == 2
    steps = {int(s["step"]) for s in trainer.runtime.optimizer.state.values()}
    assert steps == {2}, f"AdamW counted {steps}: its state did not start fresh"
    start = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["init_from"] == str(src / "checkpoints" / "step-00000003")


def test_a_run_starts_from_an_import_hf_output(source, tmp_path, data_dir):
    src, weights = source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer found for the test data folder
        export_hf(src, tmp_path / "hf", dtype="fp32")
    import_hf(tmp_path / "hf", tmp_path / "imported")
    trainer = Trainer(w.config(tmp_path / "b", str(data_dir), str(tmp_path / "imported")))
    seen = w.before_first_step(trainer)
    trainer.train()
    check_starts_from(trainer, seen, weights)


def test_a_resumed_run_does_not_read_init_from_again(source, tmp_path, data_dir):
    src, _ = source
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    Trainer(w.config(tmp_path / "b", str(data_dir), str(copy), steps=2)).train()
    shutil.rmtree(copy)  # gone: the resume must not need it
    trainer = Trainer(w.config(tmp_path / "b", str(data_dir), str(copy), steps=4))
    assert trainer.train()["step"] == 4
    start = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
             if '"start"' in x][-1]
    assert start["resumed_from_step"] == 2 and start["init_from"] is None


def test_a_source_of_another_model_is_refused_naming_the_fields(source, tmp_path, data_dir):
    src, _ = source
    cfg = w.config(tmp_path / "b", str(data_dir), str(src))
    cfg.model.num_layers = 3
    cfg.model.expert_hidden = 24
    with pytest.raises(ConfigError, match=r"train.init_from=.* holds the weights of another model \(model.expert_hidden: "
                                          r"checkpoint 16, this run 24; model.num_layers: checkpoint 2, this run 3\)"):
        Trainer(cfg).train()


def test_a_run_may_read_the_weights_with_another_rope_theta_and_other_windows(source, tmp_path, data_dir):
    """A long-context stage starts from a run's weights with a larger rope_theta and windows in its layers: the
    weights are taken as they are, with one warning naming both fields; its own resume then keeps its settings."""
    src, weights = source
    cfg = w.config(tmp_path / "b", str(data_dir), str(src))
    cfg.model.rope_theta, cfg.model.sliding_window_pattern = 500_000.0, [3, 0]
    trainer = Trainer(cfg)
    seen = w.before_first_step(trainer)
    with pytest.warns(UserWarning) as caught:
        trainer.train()
    reach = [str(x.message) for x in caught if "attention settings" in str(x.message)]
    assert reach == [f"train.init_from={str(src / 'checkpoints' / 'step-00000003')!r}: this run reads its weights "
                     "with other attention settings than they were trained with (model.rope_theta: checkpoint "
                     "10000.0, this run 500000.0; model.sliding_window_pattern: checkpoint [], this run [3, 0])"]
    check_starts_from(trainer, seen, weights)
    resumed = w.config(tmp_path / "b", str(data_dir), str(src), steps=3)
    resumed.model.rope_theta, resumed.model.sliding_window_pattern = 500_000.0, [3, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a resume reads its own checkpoint: nothing to warn about
        assert Trainer(resumed).train()["step"] == 3
    resumed.model.sliding_window_pattern = []  # a resume may not change them
    with pytest.raises(ConfigError, match=r"was written for another configuration \(model.sliding_window_pattern: "
                                          r"checkpoint \[3, 0\], this run \[\]\)"):
        Trainer(resumed).train()


def test_a_source_trained_with_the_same_reach_gives_no_warning(source, tmp_path, data_dir):
    src, _ = source
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(w.config(tmp_path / "b", str(data_dir), str(src))).train()
    assert not [x for x in caught if "attention settings" in str(x.message)]


@pytest.mark.parametrize("given,message", [
    ("missing", r"train.init_from='.*missing' does not exist: expected a run folder, a checkpoint folder or an "
                r"import-hf output"),
    ("empty", r"train.init_from='.*empty': checkpoint '.*empty': no reader recognises it"),
])
def test_a_source_that_is_not_a_checkpoint_is_refused(given, message, tmp_path, data_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=message):
        Trainer(w.config(tmp_path / "b", str(data_dir), str(tmp_path / given))).train()


def test_an_empty_init_from_is_refused():
    from moe_train.config import Config, validate

    cfg = Config()
    cfg.train.init_from = ""
    with pytest.raises(ConfigError, match="train.init_from='': expected a checkpoint's path, or null"):
        validate(cfg)


def test_a_source_holding_nan_is_refused_naming_the_tensor(source, tmp_path, data_dir):
    src, _ = source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf(src, tmp_path / "hf", dtype="fp32")
    import_hf(tmp_path / "hf", tmp_path / "imported")
    weights = load_file(tmp_path / "imported" / "model.safetensors")
    weights["blocks.1.mlp.experts.w_down"][2, 3, 4] = float("nan")
    save_file(weights, tmp_path / "imported" / "model.safetensors")
    with pytest.raises(Exception, match=r"tensor 'blocks.1.mlp.experts.w_down' holds 1 NaN / Inf values"):
        Trainer(w.config(tmp_path / "b", str(data_dir), str(tmp_path / "imported"))).train()


def test_a_damaged_source_checkpoint_is_refused_naming_train_init_from(source, tmp_path, data_dir):
    """A shard file gone from the source: the error names the setting that chose it, as the other refusals of a
    source do (it began with the shard file alone, as a resume's does; review of 0.27.3)."""
    src, _ = source
    step = src / "checkpoints" / "step-00000003"
    shard = next(step.glob("shard-*.safetensors"))
    shard.unlink()
    with pytest.raises(Exception, match=rf"^train.init_from={str(step)!r}: shard file .*{shard.name}.* is missing"):
        Trainer(w.config(tmp_path / "b", str(data_dir), str(src))).train()


@pytest.mark.parametrize("param_dtype,kind", [("fp32", "import-hf output"), ("bf16", "run folder")])
def test_a_dp2_ep2_run_starts_from_a_one_process_checkpoint(param_dtype, kind, source, tmp_path, data_dir):
    """Each rank takes only its regions: its experts, its part of the sharded fp32 masters (from a trainer
    checkpoint it reads only those; an import-hf output's tensors are read whole, once for weight and master).
    With bf16 resident weights, the masters still get the fp32 values."""
    src, weights = source
    if kind == "import-hf output":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no tokenizer found for the test data folder
            export_hf(src, tmp_path / "hf", dtype="fp32")
        import_hf(tmp_path / "hf", tmp_path / "imported")
    given = tmp_path / "imported" if kind == "import-hf output" else src
    root = tmp_path / "ranks"
    root.mkdir()
    h.start_ranks(h.run_guarded, args=(w.train_two_ranks, str(root), h.free_port(), str(root), str(data_dir), str(given),
                                  param_dtype), nprocs=2)
    results = h.load_results(root, 2)
    masters_seen = 0
    for rank, res in enumerate(results):
        assert res["summary"]["step"] == 2, rank
        for name, (shape, sl, t) in res["seen"]["shards"].items():
            if name.startswith("optim."):
                if not name.endswith(".master"):
                    assert not t.any(), (rank, name)
                    continue
                whole = weights[name[len("optim."):-len(".master")]].reshape(-1)
                assert torch.equal(t, whole[sl.start: sl.start + sl.length]), (rank, name)
                masters_seen += t.numel()
            else:
                want = weights[name][tuple(slice(o, o + n) for o, n in sl)]
                want = want.to(torch.bfloat16).float() if param_dtype == "bf16" else want
                assert torch.equal(t, want), (rank, name)
        for name, b in res["seen"]["buffers"].items():
            assert torch.equal(b, weights[name]), (rank, name)
    assert masters_seen == sum(v.numel() for k, v in weights.items() if "expert_bias" not in k)
    # and back: one process starts from the DP2 x EP2 run's checkpoint, taking its fp32 masters (not its bf16 weights)
    from moe_ckpt import LoadRequest, load_checkpoint

    two = root / "two" / "checkpoints" / "step-00000002"
    trainer = Trainer(w.config(tmp_path / "one", str(data_dir), str(two)))
    seen = w.before_first_step(trainer)
    trainer.train()
    masters = load_checkpoint(two, [LoadRequest(f"optim.{n}.master") for n in weights if "expert_bias" not in n])
    stored = {n[len("optim."):-len(".master")]: t for n, t in masters.items()}
    stored.update(load_checkpoint(two, [LoadRequest(n) for n in weights if "expert_bias" in n]))
    check_starts_from(trainer, seen, stored)
    if param_dtype == "bf16":
        bf16 = load_checkpoint(two, [LoadRequest("embed.weight")])["embed.weight"]
        assert bf16.dtype == torch.bfloat16 and not torch.equal(bf16.float(), stored["embed.weight"])
