"""QA 59: moe-train as a user runs it. How a stopped run reports itself, starting over in a run folder with history,
data settings a prepared folder never reads, and a top-1 router the loss cannot train."""

from __future__ import annotations

import json
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import SignalAtStep2, small_config  # noqa: E402

from moe_train.cli import main  # noqa: E402
from moe_train.config import ConfigError, RouterConfig  # noqa: E402
from moe_train.config_io import build_config  # noqa: E402
from moe_train.model.router import Router  # noqa: E402
from moe_train.trainer import loop  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    return prepare_data(list(stdlib_documents(100_000)), tmp_path_factory.mktemp("qa59") / "data", vocab_size=512,
                        source="stdlib-test")


def config(tmp_path, data, **train):
    cfg = small_config(tmp_path, **{"steps": 4, "eval_interval": 0, "log_interval": 1, "grad_accum": 1, **train})
    cfg.data.path, cfg.train.device = str(data), "cpu"
    return cfg


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- 1. what the end event of a stopped run says ----------------------------------------------------------------
@pytest.mark.parametrize("signum, said", [(signal.SIGINT, "SIGINT (Ctrl-C)"),
                                          (signal.SIGTERM, "SIGTERM: the job was told to stop")])
def test_an_interrupted_runs_end_event_names_the_signal_and_the_step(tmp_path, data, signum, said):
    """The end event of a Ctrl-C'd run read `"error": "KeyboardInterrupt: "`: which signal, and where, was lost."""
    cfg = config(tmp_path, data, save_interval=0)
    runtime = SignalAtStep2(cfg, torch.device("cpu"))
    runtime.signum = signum
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, runtime).train()
    end = records(tmp_path / "run")[-1]
    assert end["event"] == "end" and end["status"] == "interrupted" and end["step"] == 1, end
    assert end["error"].startswith(f"KeyboardInterrupt: {said}") and end["error"].endswith(", after step 1 of 4"), end


def test_the_clis_line_for_a_ctrl_c_says_after_which_step(tmp_path, data, monkeypatch, capsys):
    monkeypatch.setattr(loop, "make_runtime", lambda cfg, device: SignalAtStep2(cfg, device))
    argv = ["train", f"--data.path={data}", f"--train.run_dir={tmp_path / 'run'}", "--train.steps=4",
            "--train.save_interval=0", "--train.eval_interval=0", "--train.progress=false", "--train.device=cpu",
            "--model.num_layers=1", "--model.d_model=32", "--model.vocab_size=512", "--data.seq_len=32",
            "--train.micro_batch_size=2"]
    assert main(argv) == 128 + signal.SIGINT
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == "moe-train: stopped by SIGINT (Ctrl-C), after step 1 of 4", lines


# -- 2. starting over in a run folder with history ----------------------------------------------------------------
def test_no_resume_without_saves_over_checkpoints_is_refused_and_keeps_their_log(tmp_path, data):
    """--no-resume with train.save_interval=0 in a folder with checkpoints: the checks that refuse writing over a
    checkpoint are skipped (the run saves nothing), and the start dropped every step record of the run that wrote
    them; the checkpoints stayed, next to a log of another run."""
    cfg = config(tmp_path, data, save_interval=2)
    Trainer(cfg).train()
    log = tmp_path / "run" / "metrics.jsonl"
    before = log.read_bytes()
    cfg.train.save_interval, cfg.train.resume = 0, False
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(step-00000002, step-00000004\): "
                                          r"this run starts from step 0 \(train.resume=false\) and would drop the 4 "
                                          r"step records \(up to step 4\)"):
        Trainer(cfg).train()
    assert log.read_bytes() == before


def test_a_completed_run_that_saved_nothing_is_not_written_over_but_a_stopped_one_is_restarted(tmp_path, data,
                                                                                               capsys):
    """A run with train.save_interval=0 has only its log: started again, the run dropped the finished run's step
    records without a word. A run stopped before its first checkpoint is still started over, as documented."""
    cfg = config(tmp_path, data, save_interval=0)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, SignalAtStep2(cfg, torch.device("cpu"))).train()
    Trainer(cfg).train()  # the stopped run's step 1 is trained again, and logged once
    assert [r["step"] for r in records(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4]
    log = tmp_path / "run" / "metrics.jsonl"
    before = log.read_bytes()
    with pytest.raises(ConfigError, match=r"holds a completed run: this run starts from step 0 \(no complete "
                                          r"checkpoint to resume from\) and would drop the 4 step records"):
        Trainer(cfg).train()
    assert log.read_bytes() == before
    assert main(["train", f"--data.path={data}", f"--train.run_dir={tmp_path / 'run'}", "--train.save_interval=0",
                 "--no-resume"]) == 2  # the CLI: one line, exit 2, before the first step
    assert "holds a completed run: this run starts from step 0 (train.resume=false)" in capsys.readouterr().err
    assert log.read_bytes() == before


# -- 3. settings of the embedded corpus with a prepared folder ----------------------------------------------------
@pytest.mark.parametrize("field, value", [("data.default_vocab_size", "8192"), ("data.default_max_bytes", "1000"),
                                          ("data.cache_dir", "elsewhere"), ("data.eval_fraction", "0.1")])
def test_corpus_settings_a_prepared_data_folder_ignores_are_warned_about_by_name(tmp_path, field, value):
    """data.default_vocab_size (say) only sizes the BPE of the embedded corpus: with data.path a prepared folder it
    was ignored without a word, and the run trained on the folder's own vocabulary."""
    ignored = rf"^{field}=.* is ignored: only the embedded corpus \(data.path=default\) reads it"
    with pytest.warns(UserWarning, match=ignored):
        build_config("tiny", overrides={"data.path": str(tmp_path), field: value})
    yaml = tmp_path / "run.yaml"
    section, name = field.split(".")
    yaml.write_text(f"{section}:\n  path: {tmp_path}\n  {name}: {value}\n")
    with pytest.warns(UserWarning, match=ignored):
        build_config(None, str(yaml))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_config("tiny", overrides={field: value})  # the embedded corpus reads it
        # a whole config written out (`moe-train info`), data.path then changed: the preset's values change nothing
        whole = build_config("tiny").to_dict()
        whole["data"]["path"] = str(tmp_path)
        yaml.write_text(json.dumps(whole))
        build_config(None, str(yaml))


@pytest.mark.parametrize("size", [100, 2**21])
def test_an_embedded_corpus_bpe_size_out_of_range_is_refused_naming_its_field(tmp_path, size):
    """data.default_vocab_size=100 read the standard library, then failed in the BPE trainer as `vocab_size=100`,
    which reads as model.vocab_size."""
    cfg = small_config(tmp_path)
    cfg.data.path, cfg.data.cache_dir = "default", str(tmp_path / "cache")
    cfg.data.default_vocab_size, cfg.data.default_max_bytes, cfg.model.vocab_size = size, 10_000, 2**22
    with pytest.raises(ConfigError, match=rf"^data.default_vocab_size={size}: expected 257 <= it <= 1048576"):
        Trainer(cfg)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


# -- 4. a top-1 router renormalised to 1 ---------------------------------------------------------------------------
def top_1_router_gradient(normalize: bool) -> float:
    """The largest gradient the loss sends a top-1 router's weights (balancing losses off)."""
    torch.manual_seed(0)
    router = Router(16, 4, RouterConfig(top_k=1, normalize_top_k=normalize, lb_loss_weight=0, z_loss_weight=0))
    torch.nn.init.normal_(router.weight, std=0.5)
    out = router(torch.randn(64, 16))
    (out.weights * torch.randn_like(out.weights)).sum().backward()
    return router.weight.grad.abs().max().item()


def test_training_a_renormalised_top_1_router_is_refused_naming_both_fields(tmp_path, data):
    """top_k=1 with normalize_top_k (its default) trained a router the loss never reaches: p / p is 1 whatever the
    router's weights are (Megatron-Core refuses a softmax after a top-1 for this)."""
    assert top_1_router_gradient(normalize=True) < 1e-5 * top_1_router_gradient(normalize=False)
    cfg = config(tmp_path, data, save_interval=0)
    cfg.model.router = RouterConfig(top_k=1)
    with pytest.raises(ConfigError, match=r"normalize_top_k=true with model.router.top_k=1: .*no gradient"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()
    cfg.model.router = RouterConfig(top_k=1, normalize_top_k=False)
    Trainer(cfg).train()
    from moe_train.model.router import refuse_a_router_the_loss_cannot_train

    cfg.model.router = RouterConfig(top_k=1, routing="random")
    refuse_a_router_the_loss_cannot_train(cfg.model)  # benchmark routing: the router is not learned


def test_a_top_1_renormalised_run_resumes_with_renormalisation_turned_off(tmp_path, data, monkeypatch):
    """The refusal above names normalize_top_k=false as the fix; a run saved before it (by an older moe-train) must
    then resume with that one field changed, where the same-model check refused it as another network."""
    cfg = config(tmp_path, data, steps=2, save_interval=2)
    cfg.model.router = RouterConfig(top_k=1)
    with monkeypatch.context() as m:  # a checkpoint from before the refusal
        m.setattr(loop, "refuse_a_router_the_loss_cannot_train", lambda model: None)
        Trainer(cfg).train()
    cfg.train.steps = 4
    with pytest.raises(ConfigError, match="normalize_top_k=true with model.router.top_k=1"):
        Trainer(cfg)
    cfg.model.router = RouterConfig(top_k=1, normalize_top_k=False)
    summary = Trainer(cfg).train()
    assert summary["step"] == 4
    cfg.model.router = RouterConfig(top_k=1, normalize_top_k=True, gating="sigmoid")  # another change still refused
    cfg.train.steps = 6
    with pytest.raises(ConfigError, match="another configuration"):
        with monkeypatch.context() as m:
            m.setattr(loop, "refuse_a_router_the_loss_cannot_train", lambda model: None)
            Trainer(cfg).train()
