"""train.lm_z_loss_weight: the LM head's z-loss, weight x the mean logsumexp² of the logits over the scored targets.

The expected values come from the formula written out here and differentiated by autograd in float64."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_train.config import ConfigError, ModelConfig, validate
from moe_train.config_io import config_from_dict
from moe_train.model.chunked_loss import IGNORED_TARGET, chunked_head_losses
from moe_train.model.transformer import Transformer, head_losses
from moe_train.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402


def _objective(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, z_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, z term) in float64, straight from the definitions."""
    logits = h.double() @ w.double().T
    kept = t != IGNORED_TARGET
    lse = torch.logsumexp(logits, dim=-1)
    ce = (lse - logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1))[kept].mean()
    return ce, z_weight * (lse[kept] ** 2).mean()


def _case(n: int, d: int, v: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(v, d, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.randperm(n, generator=g)[: n // 4]] = IGNORED_TARGET
    return h, w, t


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 5e-6)])
@pytest.mark.parametrize("n,d,v", [(37, 16, 53), (129, 24, 301), (5, 8, 7)])
def test_both_paths_give_the_formulas_value_and_gradients(dtype, tol, n, d, v):
    h, w, t = _case(n, d, v, dtype, seed=n * v)
    z_weight, scale = 0.3, 0.7  # scale: backward's incoming gradient (1 / grad_accum)
    want_ce, want_z = _objective(h, w, t, z_weight)
    want_h, want_w = torch.autograd.grad((want_ce + want_z) * scale, [h, w])
    plain = head_losses(h @ w.T, t, z_weight)
    results = {"plain": plain} | {f"chunk {c}": chunked_head_losses(h, w, t, c, z_weight) for c in (1, 6, n, 10 * n)}
    for name, (ce, z) in results.items():
        assert ce.dtype == z.dtype == torch.promote_types(dtype, torch.float32), name
        torch.testing.assert_close(ce.double(), want_ce, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(z.double(), want_z, rtol=tol, atol=tol, msg=name)
        got_h, got_w = torch.autograd.grad((ce + z) * scale, [h, w])
        torch.testing.assert_close(got_h, want_h, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(got_w, want_w, rtol=tol, atol=tol, msg=name)


def test_the_chunked_z_term_is_detached_and_its_gradient_rides_on_the_cross_entropy():
    h, w, t = _case(23, 8, 31, torch.float64, seed=1)
    ce, z = chunked_head_losses(h, w, t, 5, 0.5)
    assert ce.requires_grad and not z.requires_grad
    want = torch.autograd.grad(sum(_objective(h, w, t, 0.5)), [h, w])
    for got, exp in zip(torch.autograd.grad(ce, [h, w]), want):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)


def test_weight_zero_adds_nothing_and_the_cross_entropy_is_unchanged_by_a_weight():
    h, w, t = _case(40, 12, 61, torch.float32, seed=2)
    logits = h @ w.T
    ce0, z0 = head_losses(logits, t, 0.0)
    ce1, z1 = head_losses(logits, t, 0.1)
    assert z0.item() == 0.0 and z1.item() > 0
    assert ce0.item() == F.cross_entropy(logits, t, ignore_index=IGNORED_TARGET).item()  # exactly the plain loss
    torch.testing.assert_close(ce1, ce0, rtol=1e-6, atol=0)  # the same sum, by one logsumexp for both terms
    c0, cz0 = chunked_head_losses(h, w, t, 7, 0.0)
    c1, cz1 = chunked_head_losses(h, w, t, 7, 0.1)
    assert cz0.item() == 0.0 and c0.item() == c1.item()
    torch.testing.assert_close(cz1, z1, rtol=1e-6, atol=0)


def test_every_target_ignored_gives_nan_terms_and_zero_gradients_on_both_paths():
    h, w, _ = _case(9, 8, 13, torch.float32, seed=3)
    t = torch.full((9,), IGNORED_TARGET)
    paths = {"plain": head_losses(h @ w.T, t, 0.2), "chunked": chunked_head_losses(h, w, t, 4, 0.2)}
    for name, (ce, z) in paths.items():
        assert math.isnan(ce.item()) and math.isnan(z.item()), name  # as F.cross_entropy gives: the trainer skips
        grads = torch.autograd.grad(ce + z if z.requires_grad else ce, [h, w])
        assert all(bool((g == 0).all()) for g in grads), name


def test_bad_weights_are_refused_by_the_config_the_model_and_the_function():
    for bad in (-1e-5, float("nan"), float("inf"), True, "x"):
        with pytest.raises(ConfigError, match="train.lm_z_loss_weight"):
            validate(config_from_dict({"train": {"lm_z_loss_weight": bad}}))
    model = Transformer(ModelConfig(vocab_size=31, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                    dense_hidden=16, num_experts=0))
    for bad in (-1.0, float("nan"), True, None):
        with pytest.raises(ValueError, match=r"lm_z_loss_weight=.*expected a finite number >= 0"):
            model.set_lm_z_loss_weight(bad)
    h, w, t = _case(4, 8, 5, torch.float32, seed=4)
    with pytest.raises(ValueError, match=r"z_loss_weight=-0.5: expected a finite number >= 0"):
        chunked_head_losses(h, w, t, 2, -0.5)


def _model(vocab: int = 97) -> Transformer:
    cfg = ModelConfig(vocab_size=vocab, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=48,
                      dense_layers=[0], num_experts=4, expert_hidden=16)
    torch.manual_seed(0)
    return Transformer(cfg)


def test_model_loss_terms_plain_and_chunked_give_the_same_objective_and_gradients():
    model = _model()
    model.set_lm_z_loss_weight(0.02)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 97, (3, 19), generator=g)
    y = torch.randint(0, 97, (3, 19), generator=g)
    y[1, 3:7] = IGNORED_TARGET
    plain = model.loss_terms(x, y)
    sum(plain).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_loss_chunk_tokens(10)
    chunked = model.loss_terms(x, y)
    sum(chunked).backward()
    for got, exp in zip(chunked, plain):
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-7)
    assert plain.lm_z.item() > 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)
    ce, rest = model.loss(x, y)  # loss(): the cross-entropy and everything the objective adds to it
    torch.testing.assert_close(rest, chunked.router_aux + chunked.lm_z)
    torch.testing.assert_close(ce, chunked.ce)


def _metrics(run_dir: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "event" not in r]


def test_trainer_logs_the_term_and_the_chunked_head_trains_the_same_steps(tmp_path, data_dir):
    def run(name: str, weight: float, chunk: int) -> list[dict]:
        cfg = small_config(tmp_path / name, steps=4, eval_interval=0, save_interval=0, loss_chunk_tokens=chunk,
                           lm_z_loss_weight=weight)
        cfg.data.path = str(data_dir)
        with Trainer(cfg) as trainer:
            assert trainer.model.lm_z_loss_weight == weight
            trainer.train()
        return _metrics(cfg.train.run_dir)

    plain, chunked, without = run("plain", 0.01, 0), run("chunked", 0.01, 7), run("without", 0.0, 0)
    assert len(plain) == 2 and all("lm_z_loss" not in r for r in without)
    for r in plain:  # lse of logits near uniform is about log(vocab): the logged term is weight x lse²
        assert 0 < r["lm_z_loss"] < 0.01 * 4 * math.log(512) ** 2, r
    for key in ("loss", "lm_z_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in chunked]), torch.tensor([r[key] for r in plain]),
                                   rtol=1e-5, atol=1e-7, msg=key)
    # the first logged step (2) already trained on step 1's z gradient: the runs differ
    assert [r["loss"] for r in plain] != [r["loss"] for r in without]


def test_a_large_weight_pulls_the_logsumexp_towards_zero(tmp_path, data_dir):
    """What the z-loss is for: trained with it, the softmax's normaliser (logsumexp of the logits) ends nearer 0
    than trained without it, on the same batches."""

    def mean_lse_squared(weight: float) -> float:
        cfg = small_config(tmp_path / f"w{weight}", steps=20, eval_interval=0, save_interval=0,
                           lm_z_loss_weight=weight)
        cfg.data.path = str(data_dir)
        with Trainer(cfg) as trainer:
            trainer.train()
            x, _ = trainer.sampler.next_batch(4, 0, 1)
            with torch.no_grad():
                logits, _ = trainer.model(x)
        return float((torch.logsumexp(logits.float(), dim=-1) ** 2).mean())

    without, with_z = mean_lse_squared(0.0), mean_lse_squared(1.0)
    assert with_z < 0.9 * without, (with_z, without)  # seen: 28.6 against 35.2


def test_the_plain_z_loss_keeps_no_more_whole_logits_for_backward_than_the_cross_entropy():
    """With a weight, the plain path keeps one fp32 copy of the logits for backward, as F.cross_entropy keeps its
    log-softmax: a second [tokens, V] tensor (a logsumexp beside F.cross_entropy) would cost GBs at vocab 100k."""
    h, w, t = _case(64, 16, 211, torch.float32, seed=6)
    whole = {}
    for weight in (0.0, 0.1):
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            head_losses(h @ w.T, t, weight)
        whole[weight] = sum(1 for n in sizes if n >= 64 * 211)
    assert whole[0.1] <= whole[0.0], whole
