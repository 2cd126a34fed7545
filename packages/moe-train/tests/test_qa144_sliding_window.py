"""QA 144: model.sliding_window_pattern (moe-train 0.26.0) as a user of the whole stack meets it, on the CPU.

Found:
- A model pickled before 0.26.0 (torch.save of the module, pickle, a deepcopy of an unpickled one) failed its first
  forward with AttributeError: 'ModelConfig' object has no attribute 'sliding_window_pattern'. The field's default is
  a default_factory, which a dataclass keeps off the class, so an instance unpickled without it has no value at all
  (Transformer.__setstate__ fills in its own later attributes for exactly that case). Fixed: ModelConfig.__setstate__
  gives a config pickled before the field its default, [] (what its writer computed: full attention).
- Resume and train.init_from compare the model fields "as the network they give" (resume_checks._network), but not
  this one: a run saved with [8, 0, 8, 0] on 4 layers refused to resume (or init from) with [8, 0] - the same windows
  in every layer, and what import-hf writes for that model (the shortest cycle, moe_ckpt pattern_of) - and [] against
  [0] likewise. Fixed: _network compares the shortest cycle of the per-layer windows the pattern gives.
- train.document_masking_kernel, which the README says serves windowed layers too, was passed to the model only
  with train.document_masking on: with windows alone the Trainer and the bench ran 'auto' whatever was set, so
  'flex' on a CPU was not refused (it ran sdpa silently) and 'sdpa' on a GPU would have run flex. Fixed: the Trainer
  and the bench always hand the model the kernel (eos_id None without document masking).
Held (kept below where they add coverage to test_sliding_window.py): gradients with the chunked loss, the LM z-loss
and activation checkpointing "mlp" / "full" equal the plain ones with windows in the layers; torch.func.vmap over a
windowed model (with and without documents); a window of S or more at a length is plain causal attention there, and
S - 1 is not; a pattern longer than num_layers; float64; CLI refusals of bad values (one line, exit 2).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_train.config import Config, ConfigError, ModelConfig, RouterConfig
from moe_train.model.transformer import Transformer
from moe_train.trainer.resume_checks import model_differences

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402

VOCAB = 61


def _model(pattern: list[int], dtype: torch.dtype = torch.float32, **fields) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(**{"vocab_size": VOCAB, "d_model": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                         "qk_norm": True, "dense_hidden": 48, "dense_layers": [0], "num_experts": 4,
                         "expert_hidden": 16, "router": RouterConfig(top_k=2), "sliding_window_pattern": pattern,
                         **fields})
    return Transformer(cfg).to(dtype)


def _tokens(b: int = 2, s: int = 17, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# -- defect 1: a model pickled before the field -------------------------------------------------------------------

def test_a_model_pickled_before_the_field_runs_with_full_attention():
    model = _model([])
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens)[0]
    del model.cfg.__dict__["sliding_window_pattern"]  # a ModelConfig pickled before 0.26.0
    old = pickle.loads(pickle.dumps(model))
    assert old.cfg.sliding_window_pattern == [] and old.cfg.attention_window(3) == 0
    with torch.no_grad():
        torch.testing.assert_close(old(tokens)[0], want, rtol=0, atol=0)
        torch.testing.assert_close(copy.deepcopy(old)(tokens)[0], want, rtol=0, atol=0)
    cfg = ModelConfig(num_layers=2)
    del cfg.__dict__["sliding_window_pattern"]
    assert pickle.loads(pickle.dumps(cfg)) == ModelConfig(num_layers=2)  # the config alone too


def test_a_windowed_model_survives_pickle_and_deepcopy():
    model = _model([3, 0, 1])
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens)[0]
        for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert copied.cfg.sliding_window_pattern == [3, 0, 1]
            torch.testing.assert_close(copied(tokens)[0], want, rtol=0, atol=0)


# -- defect 2: resume / init_from compare the windows, not their spelling -----------------------------------------

def _saved(pattern: list[int] | None) -> dict:
    model = dataclasses.asdict(ModelConfig(num_layers=4))
    if pattern is None:
        del model["sliding_window_pattern"]  # written before 0.26.0
    else:
        model["sliding_window_pattern"] = pattern
    return model


def _this_run(pattern: list[int]) -> Config:
    return Config(model=ModelConfig(num_layers=4, sliding_window_pattern=pattern))


@pytest.mark.parametrize("saved, run", [([8, 0, 8, 0], [8, 0]), ([8, 0], [8, 0, 8, 0]), ([], [0]), ([0, 0], []),
                                        (None, [0]), ([5], [5, 5, 5, 5]), ([5, 0, 0, 0, 5], [5, 0, 0, 0])])
def test_the_same_windows_spelled_otherwise_resume(saved, run):
    assert model_differences(_saved(saved), _this_run(run)) == []


@pytest.mark.parametrize("saved, run", [([8, 0, 8, 0], [0, 8]), ([], [8]), (None, [8, 0]), ([8, 0, 0], [8, 0]),
                                        ([8], [9])])
def test_other_windows_are_still_refused_naming_the_field(saved, run):
    diffs = model_differences(_saved(saved), _this_run(run))
    assert len(diffs) == 1 and diffs[0].startswith("model.sliding_window_pattern: checkpoint ")


def test_init_from_an_import_hf_pattern_of_the_same_windows_is_taken(tmp_path):
    """export-hf then import-hf writes the shortest cycle ([8, 0] for [8, 0, 8, 0]): the run's own config must take
    those weights as its network's."""
    from moe_ckpt.hf.windows import layer_windows, pattern_of

    run = _this_run([8, 0, 8, 0])
    imported = pattern_of(layer_windows(dataclasses.asdict(run.model)))
    assert imported == [8, 0]
    assert model_differences(_saved(imported), run) == []


# -- defect 3: train.document_masking_kernel serves windowed layers without document masking --------------------

def _windowed_config(tmp_path, kernel: str, **train) -> Config:
    cfg = small_config(tmp_path, document_masking_kernel=kernel, device="cpu", **train)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, sliding_window_pattern=[5, 0]))


def test_the_trainer_takes_the_kernel_for_windows_alone(tmp_path, data_dir):
    from moe_train.trainer.loop import Trainer

    with pytest.raises(ConfigError, match=r"train.document_masking_kernel='flex'.*cpu"):
        Trainer(_windowed_config(tmp_path, "flex"))  # it ran sdpa, silently
    assert not (tmp_path / "run").exists()
    with Trainer(_windowed_config(tmp_path, "sdpa", steps=1, warmup_steps=0, eval_interval=1,
                                                    save_interval=0)) as trainer:
        assert (trainer.model.document_eos_id, trainer.model.document_mask_kernel) == (None, "sdpa")  # was "auto":
        # flex on a GPU where it runs, against the setting
        trainer.train()
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_bench_takes_the_kernel_for_windows_alone(tmp_path):
    from moe_train.bench import run_bench

    cfg = _windowed_config(tmp_path, "sdpa", grad_accum=1)
    cfg.data.seq_len = 16
    result = run_bench(cfg, steps=1, warmup=0)
    assert (result["document_masking_kernel"], result["document_masking_path"]) == ("sdpa", "sdpa")
    assert (result["seq_len"], result["sliding_window_pattern"]) == (16, [5, 0])  # a result says what it timed
    with pytest.raises(ConfigError, match=r"train.document_masking_kernel='flex'"):
        run_bench(_windowed_config(tmp_path, "flex", grad_accum=1), steps=1, warmup=0)


# -- held: the model's training paths with windows ----------------------------------------------------------------

def _grads(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    sum(model.loss_terms(tokens[:, :-1], tokens[:, 1:])).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("setting", ["chunked", "checkpoint_mlp", "checkpoint_full", "z_loss_zero"])
def test_windowed_gradients_do_not_depend_on_how_the_step_is_computed(setting):
    model = _model([3, 0, 1, 16])
    model.set_document_masking(5)
    tokens = _tokens(s=19)
    want = _grads(model, tokens)
    other = copy.deepcopy(model)
    {"chunked": lambda: other.set_loss_chunk_tokens(5),
     "checkpoint_mlp": lambda: other.set_activation_checkpointing("mlp"),
     "checkpoint_full": lambda: other.set_activation_checkpointing("full"),
     "z_loss_zero": lambda: other.set_lm_z_loss_weight(0.0)}[setting]()
    for a, b in zip(want, _grads(other, tokens), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_the_z_loss_reads_the_windowed_logits():
    model = _model([2])
    model.set_lm_z_loss_weight(1e-2)
    tokens = _tokens()
    terms = model.loss_terms(tokens[:, :-1], tokens[:, 1:])
    causal = _model([])
    causal.load_state_dict(model.state_dict())
    causal.set_lm_z_loss_weight(1e-2)
    assert all(torch.isfinite(t) for t in terms)
    assert sum(terms).item() != sum(causal.loss_terms(tokens[:, :-1], tokens[:, 1:])).item()


@pytest.mark.parametrize("eos_id", [None, 5])
def test_vmap_batches_the_windowed_forward(eos_id):
    model = _model([3, 0], num_layers=2, num_experts=0, dense_layers=[])
    model.set_document_masking(eos_id)
    tokens = _tokens(b=3, s=10).unsqueeze(1)  # [N, 1, S]
    with torch.no_grad(), pytest.warns(UserWarning, match="batching rule"):
        got = torch.func.vmap(lambda t: model(t)[0])(tokens)
    with torch.no_grad():
        for i in range(3):
            torch.testing.assert_close(got[i], model(tokens[i])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, causal", [(15, False), (16, True), (17, True), (1000, True)])
def test_a_window_of_the_length_or_more_is_causal_attention_at_that_length(window, causal):
    windowed, full = _model([window]), _model([])
    full.load_state_dict(windowed.state_dict())
    tokens = _tokens(s=16)
    with torch.no_grad():
        same = torch.equal(windowed(tokens)[0], full(tokens)[0])
    assert same is causal


def test_a_pattern_longer_than_the_layers_and_float64():
    model = _model([2, 3, 4, 5, 6, 7], torch.float64)
    assert [model.cfg.attention_window(i) for i in range(4)] == [2, 3, 4, 5]
    tokens = _tokens()
    with torch.no_grad():
        out = model(tokens)[0]
        # float64 end to end: a token's logits change only through keys within its receptive field (2+3+4+5-3 = 11)
        changed = tokens.clone()
        changed[:, 0] = (changed[:, 0] + 1) % VOCAB
        delta = (model(changed)[0] - out).abs().amax(-1)
    assert out.dtype == torch.float64
    # (beyond it only round-off: the MoE layers group a row's tokens by expert, so another token's route can reorder a
    # sum by an ulp)
    assert (delta[:, 11:] < 1e-12).all() and (delta[:, :11] > 1e-6).all()


@pytest.mark.parametrize("value, message", [
    ("[-1]", "model.sliding_window_pattern=[-1]: expected a list of integers >= 0"),
    ("[[4]]", "model.sliding_window_pattern[]=[4]: expected an integer"),
])
def test_the_cli_refuses_a_bad_pattern_in_one_line(value, message):
    cli = [sys.executable, "-c", "import sys; from moe_train.cli import main; sys.exit(main())"]
    r = subprocess.run(cli + ["info", f"--model.sliding_window_pattern={value}"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"moe-train: error: {r.stderr.split('error: ', 1)[1].strip()}"]
    assert message in r.stderr


def test_config_error_is_what_validate_raises():
    from moe_train.config import validate
    from moe_train.config_io import config_from_dict

    with pytest.raises(ConfigError, match=r"model.sliding_window_pattern=\[3, -2\]"):
        validate(config_from_dict({"model": {"sliding_window_pattern": [3, -2]}}))


def test_a_refusal_for_another_layer_count_names_no_pattern_it_did_not_change():
    saved = _saved([])
    saved["num_layers"] = 2
    assert model_differences(saved, _this_run([])) == ["model.num_layers: checkpoint 2, this run 4"]
    saved["sliding_window_pattern"] = [8, 0]
    assert model_differences(saved, _this_run([8, 0, 8, 0])) == ["model.num_layers: checkpoint 2, this run 4"]
    assert model_differences(saved, _this_run([8])) == [
        "model.num_layers: checkpoint 2, this run 4", "model.sliding_window_pattern: checkpoint [8, 0], this run [8]"]
