"""QA 139: train.lm_z_loss_weight (moe-train 0.23.0), the LM head's z-loss, in real CPU runs.

Found:
- With a weight, the plain (whole-logits) head's loss on the CPU raised RuntimeError ("index 31 is out of bounds for
  dimension 1 with size 31", from the gather) for a target outside [0, V), where without a weight, on the chunked
  path, and under train.compile (which routes such a batch to the eager loss for the IndexError) it raises IndexError
  naming the target. Fixed: head_losses checks the targets on the CPU outside a compiled graph, as the chunked head
  does (test_an_out_of_range_target_raises_index_error_with_a_weight_on_every_path,
  test_an_out_of_range_target_under_compile_with_a_weight_raises_index_error).

Held:
- The logged lm_z_loss is the weighted mean logsumexp² averaged over the micro-batches (grad_accum 2), by hand from
  a copy of the model before the step; absent with weight 0.
- The eval loss stays the cross-entropy alone: step-0 eval with a large weight equals the run without it.
- bf16 resident weights (DistributedRuntime at world size 1), plain and chunked heads with the z-loss, with
  activation checkpointing: finite, the same loss and lm_z_loss on both heads to bf16 rounding.
- A resume with another weight trains with the new one, silently; the router's lb/z weights change silently at a
  resume as well (training-only fields), and neither changes the lr schedule nor the data: silence is consistent.
- A z term that alone overflows (weight 1e38) skips the step; the stop names lm_z_loss.
- Plain head: gradcheck and gradgradcheck in float64 (double backward with the z-loss).
- train.compile on the CPU with a weight: eager's losses and gradients, no recompilation from one batch to the next.
- deepcopy / pickle keep the weight; a model pickled before the attribute loads with 0.
- A tied-embedding dense model, chunk larger than the tokens, weights 1e-12, 1e3, -0.0 and int 2: both heads agree.
- A run with --train.lm_z_loss_weight=1e-5 (CLI) exports to HF, imports, and a run from it (with the weight) starts
  at the first run's last eval loss.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from moe_train.config import ModelConfig
from moe_train.model.chunked_loss import IGNORED_TARGET, chunked_head_losses
from moe_train.model.transformer import Transformer, head_losses
from moe_train.trainer.errors import TrainingError
from moe_train.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402


def _tiny(vocab: int = 31, tied: bool = False) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=vocab, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                   dense_hidden=16, num_experts=0, tie_embeddings=tied))


def _records(run_dir: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" not in r]


# -- found ----------------------------------------------------------------------------------------------------------

def test_an_out_of_range_target_raises_index_error_with_a_weight_on_every_path():
    model = _tiny()
    x = torch.randint(0, 31, (2, 5), generator=torch.Generator().manual_seed(0))
    for bad in (31, -5):
        y = x.clone()
        y[0, 1] = bad
        for weight in (0.0, 0.1):
            model.set_lm_z_loss_weight(weight)
            for chunk in (0, 3):
                model.set_loss_chunk_tokens(chunk)
                with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
                    model.loss_terms(x, y)
    logits = torch.randn(4, 7)
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        head_losses(logits, torch.tensor([0, 7, -100, 1]), 0.5)


# -- held -----------------------------------------------------------------------------------------------------------

def test_logged_lm_z_loss_is_the_micro_batch_mean_by_hand_and_eval_is_the_cross_entropy(tmp_path, data_dir):
    def trainer(name: str, weight: float) -> Trainer:
        cfg = small_config(tmp_path / name, steps=1, grad_accum=2, log_interval=1, eval_interval=1, warmup_steps=1,
                           save_interval=0, lm_z_loss_weight=weight)
        cfg.data.path = str(data_dir)
        return Trainer(cfg)

    with trainer("z", 0.25) as tr:
        model, sampler = copy.deepcopy(tr.model), copy.deepcopy(tr.sampler)
        tr.train()
    z_terms = []
    with torch.no_grad():
        for _ in range(2):
            x, y = sampler.next_batch(4, 0, 1)
            logits, _ = model(x)
            lse = torch.logsumexp(logits.double(), dim=-1)
            z_terms.append(0.25 * (lse**2).mean().item())
    (first_eval, step, last_eval) = _records(str(tmp_path / "z" / "run"))
    assert step["lm_z_loss"] == pytest.approx(sum(z_terms) / 2, rel=1e-5)
    with trainer("none", 0.0) as tr:
        tr.train()
    (first_eval0, step0, _) = _records(str(tmp_path / "none" / "run"))
    assert "lm_z_loss" not in step0
    assert step0["loss"] == pytest.approx(step["loss"], rel=1e-6)  # the first step's loss: the same weights
    assert first_eval["eval_loss"] == pytest.approx(first_eval0["eval_loss"], rel=1e-6)  # no z in the eval


def test_bf16_resident_weights_with_checkpointing_train_both_heads_alike(tmp_path, data_dir):
    def run(name: str, chunk: int) -> list[dict]:
        cfg = small_config(tmp_path / name, steps=2, log_interval=1, eval_interval=2, save_interval=0,
                           loss_chunk_tokens=chunk, lm_z_loss_weight=1e-3, activation_checkpointing="full")
        cfg.data.path = str(data_dir)
        cfg.parallel.param_dtype = "bf16"
        with Trainer(cfg) as tr:
            assert {p.dtype for p in tr.model.parameters()} == {torch.bfloat16}
            tr.train()
        return [r for r in _records(cfg.train.run_dir) if "loss" in r]

    plain, chunked = run("plain", 0), run("chunked", 1000)  # a chunk larger than the micro-batch's 128 tokens
    for p, c in zip(plain, chunked):
        assert p["skipped"] == 0 and math.isfinite(p["lm_z_loss"])
        for key in ("loss", "lm_z_loss"):
            assert c[key] == pytest.approx(p[key], rel=2e-3), key


def test_resume_with_another_weight_trains_with_it_silently(tmp_path, data_dir):
    def run(steps: int, weight: float) -> list[dict]:
        cfg = small_config(tmp_path, steps=steps, log_interval=1, eval_interval=0, save_interval=2,
                           grad_accum=1, lm_z_loss_weight=weight)
        cfg.data.path = str(data_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a resume warning would fail the run
            with Trainer(cfg) as tr:
                tr.train()
                assert tr.model.lm_z_loss_weight == weight
        return [r for r in _records(cfg.train.run_dir) if "loss" in r]

    before = run(2, 0.01)
    after = run(3, 0.5)
    assert [r["step"] for r in after] == [1, 2, 3]
    lse2_before, lse2_after = before[-1]["lm_z_loss"] / 0.01, after[-1]["lm_z_loss"] / 0.5
    assert 0.5 < lse2_after / lse2_before < 2  # the same logits' scale: the term carries the new weight


def test_a_z_term_that_alone_overflows_skips_the_step_and_the_stop_names_it(tmp_path, data_dir):
    cfg = small_config(tmp_path, steps=3, max_skipped_steps=2, eval_interval=0, save_interval=0, grad_accum=1,
                       log_interval=1, lm_z_loss_weight=1e38)
    cfg.data.path = str(data_dir)
    with Trainer(cfg) as tr, pytest.raises(TrainingError, match=r"lm_z_loss=inf .*non-finite for 2 consecutive"):
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        tr.train()
    assert all(torch.equal(p, before[n]) for n, p in tr.model.named_parameters())  # no update
    recs = [r for r in _records(cfg.train.run_dir) if "loss" in r]
    assert recs[0]["skipped"] == 1 and recs[0]["lm_z_loss"] is None and math.isfinite(recs[0]["loss"])


def test_plain_head_losses_pass_gradcheck_and_gradgradcheck_in_float64():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 4, IGNORED_TARGET, 2, 1, IGNORED_TARGET])

    def objective(x):
        return sum(head_losses(x, t, 0.3))

    assert torch.autograd.gradcheck(objective, (logits,))
    assert torch.autograd.gradgradcheck(objective, (logits,))


def test_compile_with_a_weight_gives_eager_losses_and_compiles_once(tmp_path):
    eager, compiled = _tiny(vocab=61), _tiny(vocab=61)
    compiled.set_compile(True)
    for m in (eager, compiled):
        m.set_lm_z_loss_weight(0.05)
    g = torch.Generator().manual_seed(1)
    graphs = []
    for _ in range(3):
        x, y = torch.randint(0, 61, (2, 9), generator=g), torch.randint(0, 61, (2, 9), generator=g)
        y[0, :3] = IGNORED_TARGET
        got = []
        for m in (eager, compiled):
            m.zero_grad()
            terms = m.loss_terms(x, y)
            sum(terms).backward()
            got.append(([t.detach() for t in terms], [p.grad.clone() for p in m.parameters()]))
        for a, b in zip(got[0][0] + got[0][1], got[1][0] + got[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[2] == graphs[0], graphs  # no recompilation after the first batch
    _COMPILED.append(compiled)


_COMPILED: list[Transformer] = []  # the model the test above compiled (no second compilation for the one below)


def test_an_out_of_range_target_under_compile_with_a_weight_raises_index_error():
    """Found (fixed): loss_terms sends such a CPU batch to the eager loss for its IndexError; with a weight that
    path raised RuntimeError from its gather."""
    if _COMPILED:
        compiled = _COMPILED[0]
    else:
        compiled = _tiny(vocab=61)
        compiled.set_compile(True)
        compiled.set_lm_z_loss_weight(0.05)
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[1, 2] = 61
    with pytest.raises(IndexError, match="Target 61 is out of bounds"):
        compiled.loss_terms(x, y)


def test_deepcopy_and_pickle_keep_the_weight_and_an_old_pickle_gets_zero():
    model = _tiny()
    model.set_lm_z_loss_weight(0.125)
    assert copy.deepcopy(model).lm_z_loss_weight == 0.125
    assert pickle.loads(pickle.dumps(model)).lm_z_loss_weight == 0.125
    del model.__dict__["lm_z_loss_weight"]  # as a model pickled before 0.23.0
    old = pickle.loads(pickle.dumps(model))
    assert old.lm_z_loss_weight == 0.0
    x = torch.randint(0, 31, (1, 4))
    assert old.loss_terms(x, x).lm_z.item() == 0.0


@pytest.mark.parametrize("weight", [1e-12, 1e3, -0.0, 2])
def test_tied_dense_model_both_heads_agree_at_odd_weights_and_chunks(weight):
    model = _tiny(tied=True)
    model.set_lm_z_loss_weight(weight)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 31, (2, 7), generator=g), torch.randint(0, 31, (2, 7), generator=g)
    y[1, :4] = IGNORED_TARGET
    results = {}
    for chunk in (0, 1, 5, 14, 100):
        model.set_loss_chunk_tokens(chunk)
        model.zero_grad()
        terms = model.loss_terms(x, y)
        sum(terms).backward()
        results[chunk] = ([t.detach() for t in terms], [p.grad.clone() for p in model.parameters()])
    want = results.pop(0)
    if not weight:
        assert want[0][2].item() == 0.0
    for chunk, got in results.items():
        for a, b in zip(got[0] + got[1], want[0] + want[1]):  # fp32 sums of another order: to the tensor's scale
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6 * max(1.0, b.abs().max().item()), msg=f"chunk {chunk}")
    h = torch.randn(3, 16, dtype=torch.float64)
    w = torch.randn(31, 16, dtype=torch.float64)
    t = torch.tensor([1, IGNORED_TARGET, 30])
    ce, z = chunked_head_losses(h, w, t, 2, weight)
    ce_p, z_p = head_losses(h @ w.T, t, weight)
    torch.testing.assert_close((ce, z), (ce_p, z_p), rtol=1e-12, atol=0)


def test_a_run_with_the_z_loss_exports_imports_and_starts_another_with_it(tmp_path, data_dir, capsys):
    """The README's init_from flow through the CLI with --train.lm_z_loss_weight=1e-5 (as typed) on both runs: the
    train-only field leaves the HF export and import alone, and the new run starts from the exported weights."""
    from moe_train.cli import main

    shape = ["--model.vocab_size=512", "--model.num_layers=2", "--model.d_model=32", "--model.expert_hidden=16",
             "--train.eval_windows=4", "--data.seq_len=32"]
    run = ["--train.device=cpu", "--train.progress=false", "--train.micro_batch_size=2", "--train.warmup_steps=1",
           "--train.log_interval=1", f"--data.path={data_dir}", "--train.lm_z_loss_weight=1e-5"]
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["train", "--preset", "tiny", *shape, *run, f"--train.run_dir={first}", "--train.steps=2",
                 "--train.eval_interval=2", "--train.save_interval=2"]) == 0
    assert main(["export-hf", str(first), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "imported" / "config.json"), *run, "--train.eval_windows=4",
                 "--data.seq_len=32", f"--train.run_dir={again}", f"--train.init_from={tmp_path / 'imported'}",
                 "--train.steps=1", "--train.eval_interval=1"]) == 0
    assert "warning" not in capsys.readouterr().err
    old, new = _records(str(first)), _records(str(again))
    assert [r for r in new if "eval_loss" in r][0]["eval_loss"] == pytest.approx(
        [r for r in old if "eval_loss" in r][-1]["eval_loss"], rel=1e-6)
    assert all(r["lm_z_loss"] > 0 for r in old + new if "loss" in r)
