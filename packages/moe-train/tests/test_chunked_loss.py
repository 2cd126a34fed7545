"""train.loss_chunk_tokens: the LM head and cross-entropy a chunk of tokens at a time (model/chunked_loss.py).

The expected values are the plain path's: F.cross_entropy over the whole logits, differentiated by autograd."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_train.config import ConfigError, ModelConfig, validate
from moe_train.config_io import config_from_dict
from moe_train.model.chunked_loss import (IGNORED_TARGET, _chunk_loss_and_grad, _compiled_chunk_loss_and_grad,
                                          chunked_head_cross_entropy)
from moe_train.model.transformer import Transformer
from moe_train.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402


def _plain(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain path: logits in the GEMM dtype (h cast as autocast casts a linear's input), the loss in fp32."""
    logits = h.to(w.dtype) @ w.T
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets,
                           ignore_index=IGNORED_TARGET)


def _case(n: int, d: int, v: int, dtype: torch.dtype, seed: int, ignored: int = 3):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=dtype) * 0.3).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.randperm(n, generator=g)[:ignored]] = IGNORED_TARGET
    return h, w, t


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("n,d,v", [(37, 16, 53), (129, 24, 301), (5, 8, 7)])
def test_loss_and_gradients_match_the_plain_loss_at_every_chunk_size(dtype, tol, n, d, v):
    h, w, t = _case(n, d, v, dtype, seed=n + v)
    scale = 0.37  # backward's incoming gradient (1 / grad_accum, a loss weight) reaches both gradients
    want = _plain(h, w, t)
    want_h, want_w = torch.autograd.grad(want * scale, [h, w])
    for chunk in (1, 7, n - 1, n, 10 * n):
        got = chunked_head_cross_entropy(h, w, t, max(chunk, 1))
        got_h, got_w = torch.autograd.grad(got * scale, [h, w])
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(got_h, want_h, rtol=tol, atol=tol)
        torch.testing.assert_close(got_w, want_w, rtol=tol, atol=tol)


def test_bf16_gemm_weight_with_fp32_hidden_states_as_under_autocast():
    """The head's GEMM weight in bf16 (what the recipe's linear casts it to under autocast) and fp32 hidden states:
    logits rounded to bf16, the loss in fp32; the gradients differ from the plain path's by bf16 rounding only."""
    h, w32, t = _case(300, 64, 509, torch.float32, seed=1)
    w = w32.detach().to(torch.bfloat16).requires_grad_()
    want = _plain(h, w, t)
    want_h, want_w = torch.autograd.grad(want, [h, w])
    got = chunked_head_cross_entropy(h, w, t, 64)
    got_h, got_w = torch.autograd.grad(got, [h, w])
    assert got.dtype == torch.float32 and got_h.dtype == torch.float32 and got_w.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the same bf16 logits, reduced in fp32
    torch.testing.assert_close(got_h, want_h, rtol=2e-2, atol=2e-5)
    torch.testing.assert_close(got_w, want_w, rtol=2e-2, atol=2e-5)


def test_targets_the_plain_loss_handles_the_same_way():
    h, w, t = _case(11, 8, 13, torch.float64, seed=2, ignored=0)
    every_ignored = torch.full_like(t, IGNORED_TARGET)
    assert torch.isnan(chunked_head_cross_entropy(h, w, every_ignored, 4))  # as F.cross_entropy gives
    assert torch.isnan(_plain(h, w, every_ignored))
    for bad in (13, -5):
        t_bad = t.clone()
        t_bad[6] = bad
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds.*target 6 of 11.*\\[0, 13\\)"):
            chunked_head_cross_entropy(h, w, t_bad, 4)
    with pytest.raises(ValueError, match="chunk_tokens=0: expected a positive"):
        chunked_head_cross_entropy(h, w, t, 0)
    with pytest.raises(ValueError, match=r"targets of shape \(10,\) do not match the hidden states' \(11,\)"):
        chunked_head_cross_entropy(h, w, t[:10], 4)


def test_batched_shapes_no_grad_and_one_input_needing_a_gradient():
    h, w, t = _case(24, 8, 17, torch.float64, seed=3)
    want = _plain(h, w, t)
    got = chunked_head_cross_entropy(h.reshape(4, 6, 8), w, t.reshape(4, 6), 5)
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(chunked_head_cross_entropy(h, w, t, 5), want)
    frozen = w.detach()
    (only_h,) = torch.autograd.grad(chunked_head_cross_entropy(h, frozen, t, 5), [h])
    torch.testing.assert_close(only_h, torch.autograd.grad(_plain(h, frozen, t), [h])[0])


def _model(tie: bool, vocab: int = 97) -> Transformer:
    cfg = ModelConfig(vocab_size=vocab, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=48,
                      dense_layers=[0], num_experts=4, expert_hidden=16, tie_embeddings=tie)
    torch.manual_seed(0)
    return Transformer(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_and_every_parameter_gradient_match_unchunked(tie):
    model = _model(tie)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 97, (3, 19), generator=g)
    y = torch.randint(0, 97, (3, 19), generator=g)
    y[1, 3:7] = IGNORED_TARGET
    ce, aux = model.loss(x, y)
    (ce + aux).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_loss_chunk_tokens(10)
    ce2, aux2 = model.loss(x, y)
    (ce2 + aux2).backward()
    torch.testing.assert_close(ce2, ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aux2, aux)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)
    logits, _ = model(x)  # forward still hands out the logits
    assert logits.shape == (3, 19, 97)


def test_chunked_loss_keeps_no_tensor_of_the_whole_logits_for_backward():
    """What autograd saves between forward and backward: the plain path keeps [tokens, V]-sized tensors (the logits
    and their fp32 copy), the chunked one nothing near that size (the head's weight, or a block's activations)."""
    model = _model(False, vocab=997)
    x = torch.randint(0, 997, (4, 50))
    sizes: dict[int, list[int]] = {0: [], 16: []}
    for chunk in sizes:
        model.set_loss_chunk_tokens(chunk)
        with torch.autograd.graph.saved_tensors_hooks(lambda t, s=sizes[chunk]: s.append(t.numel()) or t, lambda t: t):
            model.loss(x, x)
    whole_logits = 4 * 50 * 997
    assert max(sizes[0]) >= whole_logits
    assert max(sizes[16]) <= 997 * 32 < whole_logits / 6  # the head's weight's gradient (held for backward)


def test_config_field_reaches_the_model_and_bad_values_are_refused(tmp_path, data_dir):
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens.*-1.*integer >= 0"):
        validate(config_from_dict({"train": {"loss_chunk_tokens": -1}}))
    model = _model(False)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="loss_chunk_tokens=.*expected an integer >= 0"):
            model.set_loss_chunk_tokens(bad)

    def run(name: str, chunk: int) -> list[float]:
        cfg = small_config(tmp_path / name, steps=3, eval_interval=0, save_interval=0, loss_chunk_tokens=chunk)
        cfg.data.path = str(data_dir)
        trainer = Trainer(cfg)
        assert trainer.model.loss_chunk_tokens == chunk
        trainer.train()
        lines = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r and "event" not in r]

    plain, chunked = run("plain", 0), run("chunked", 7)
    assert len(plain) == 2  # log_interval 2 over 3 steps: steps 2 and 3
    torch.testing.assert_close(torch.tensor(chunked), torch.tensor(plain), rtol=1e-5, atol=1e-6)


def test_the_compiled_chunk_function_a_gpu_runs_equals_the_eager_one():
    """On a GPU each chunk's softmax, loss and logit gradient run as one torch.compile'd function; compiled here on
    the CPU (inductor's C++ backend), it gives the eager function's values, with and without the gradient, with and
    without the LM head's z-loss folded into the gradient."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(9, 301, generator=g) * 4).to(dtype)
        targets = torch.randint(0, 301, (9,), generator=g)
        kept = torch.rand(9, generator=g) > 0.3
        scale = torch.tensor(1 / 7.0)
        for z_weight, want_grad in ((0.0, True), (0.0, False), (0.25, True)):
            want = _chunk_loss_and_grad(logits.clone(), targets, kept, scale, z_weight, want_grad)
            got = _compiled_chunk_loss_and_grad()(logits.clone(), targets, kept, scale, z_weight, want_grad)
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5)
            if want_grad:
                assert got[2].dtype == dtype
                torch.testing.assert_close(got[2], want[2], rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                           atol=1e-6)
            else:
                assert got[2] is None and want[2] is None
