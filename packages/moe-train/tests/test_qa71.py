"""QA pass 71: the numbers moe-train reports (parameter counts, FLOPs per token, the metrics.jsonl step and eval
records, `moe-train info`), each recomputed here from first principles, never through the code under test."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer, count_params, flops_per_token
from moe_train.trainer.loop import Trainer


# -- by hand -----------------------------------------------------------------------------------------------------
def hand_counts(c: ModelConfig, seq_len: int) -> tuple[int, int, int, int]:
    """(total, active, embedding, training FLOPs per token) of the README's architecture, counted layer by layer."""
    d, h, kv = c.d_model, c.num_heads, c.num_kv_heads
    hd = c.head_dim if c.head_dim is not None else d // h
    total = active = d  # the final RMSNorm
    matmul = 0
    for i in range(c.num_layers):
        proj = d * h * hd + 2 * d * kv * hd + h * hd * d  # q, k, v, o (no bias on o)
        extra = 2 * d + (2 * hd if c.qk_norm else 0) + ((h + 2 * kv) * hd if c.attention_bias else 0)
        total, active, matmul = total + proj + extra, active + proj + extra, matmul + proj
        if c.num_experts > 0 and i not in c.dense_layers:
            expert = 3 * d * c.expert_hidden  # gate, up, down
            shared = 3 * d * c.shared_expert_hidden + (d if c.shared_expert_gate else 0)
            router = d * c.num_experts
            total += c.num_experts * expert + shared + router
            active += c.router.top_k * expert + shared + router
            matmul += c.router.top_k * expert + shared + router
        else:
            total, active, matmul = total + 3 * d * c.dense_hidden, active + 3 * d * c.dense_hidden, \
                matmul + 3 * d * c.dense_hidden
    embedding = c.vocab_size * d * (1 if c.tie_embeddings else 2)
    matmul += c.vocab_size * d  # the lm head (tied or not); the input embedding is a lookup
    # causal attention: QK^T and AV, 2 flops a MAC, S/2 keys on average, per head, x3 for forward + backward
    attention = 3 * c.num_layers * h * 2 * (2 * hd * seq_len // 2)
    return total + embedding, active + embedding, embedding, 6 * matmul + attention


MODELS = {
    "dense": dict(num_experts=0, dense_hidden=40),
    "moe_tied_bias_qk": dict(tie_embeddings=True, attention_bias=True, qk_norm=True, dense_layers=[1]),
    "shared_gated_headdim_rotary": dict(shared_expert_hidden=24, shared_expert_gate=True, head_dim=12,
                                        rotary_fraction=0.5, num_kv_heads=1, dense_layers=[0, 2]),
    "shared_ungated_top3": dict(shared_expert_hidden=8, num_experts=6, router=RouterConfig(top_k=3)),
}


@pytest.mark.parametrize("name", MODELS)
def test_parameter_counts_and_flops_per_token_match_a_hand_count_and_the_built_model(name):
    """Guard (verified right): count_params (total / active / embedding) and flops_per_token equal a layer-by-layer
    hand count, and total equals the built Transformer's parameter count (tied weights counted once)."""
    cfg = ModelConfig(**{**dict(vocab_size=100, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                                dense_hidden=48, num_experts=4, expert_hidden=16, gemm_backend="torch"), **MODELS[name]})
    total, active, embedding, flops = hand_counts(cfg, 24)
    counts = count_params(cfg)
    assert (counts.total, counts.active, counts.embedding) == (total, active, embedding)
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == total
    assert flops_per_token(cfg, 24) == flops


def test_info_reports_the_readme_sizes_of_olmo3_bench_e128(capsys):
    """Guard: `moe-train info --preset olmo3-bench-e128` prints 46.86B total / 3.17B active (README table), the
    hand count of d=4096, 8 layers (layer 0 dense SwiGLU of 20480), 32 heads / 8 KV heads of 128, 128 experts of
    4096 at top-4 + a shared expert of 4096, vocab 100352 untied; FLOPs at seq 8192."""
    from moe_train.cli import main
    from moe_train.presets import get_preset

    assert main(["info", "--preset", "olmo3-bench-e128"]) in (0, None)
    out = json.loads(capsys.readouterr().out)
    total, active, embedding, flops = hand_counts(get_preset("olmo3-bench-e128").model, 8192)
    assert (total, active, embedding, flops) == (46_862_505_984, 3_174_635_520, 822_083_584, 18_191_745_024)
    assert (out["params_total"], out["params_active"], out["params_embedding"], out["flops_per_token"]) == \
        (total, active, embedding, flops)
    assert round(total / 1e9, 2) == 46.86 and round(active / 1e9, 2) == 3.17


# -- the training records --------------------------------------------------------------------------------------
def schedule_by_hand(step: int, base: float, warmup: int, total: int, floor: float, schedule: str,
                     fraction: float) -> float:
    """README: step 1 at lr/warmup, linear to lr at step `warmup`; then the shape, reaching lr x min_lr_ratio one
    step past the last. 0-based `step`."""
    if step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    if schedule == "wsd":
        start = max(warmup, total - max(2, round(fraction * total)))
        done = max(0, step - start) / (total - start)
    else:
        done = (step - warmup) / (total - warmup)
    if schedule == "cosine":
        return base * (floor + (1 - floor) * (1 + math.cos(math.pi * done)) / 2)
    return base * (1 - (1 - floor) * done)


@pytest.mark.parametrize("schedule,warmup,steps", [("cosine", 2, 5), ("wsd", 1, 6)])
def test_step_records_log_the_schedule_lr_the_preclip_norm_and_the_micro_batch_mean_loss(
        tmp_path, data_dir, make_config, schedule, warmup, steps):
    """Guard: every step record's lr is the README schedule at that step (first and last included), grad_norm the
    global L2 norm of the gradients before clipping (grad_clip far below it), loss and aux_loss the means of the
    step's two micro-batches."""
    cfg = make_config(tmp_path, steps=steps, grad_accum=2, log_interval=1, eval_interval=0, save_interval=0,
                      warmup_steps=warmup, lr_schedule=schedule, grad_clip=0.01)
    cfg.train.device = "cpu"
    if schedule == "wsd":
        cfg.train.lr_decay_fraction = 0.34  # the last 2 of 6 steps
    trainer = Trainer(cfg)
    norms, losses = [], []
    real_step, real_loss = trainer.runtime.step, trainer.model.loss_terms

    def step(lr):  # noqa: ANN001, ANN202
        grads = [p.grad.double() for p in trainer.model.parameters() if p.grad is not None]
        norms.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)))
        return real_step(lr)

    def loss_terms(x, y):  # noqa: ANN001, ANN202
        terms = real_loss(x, y)
        losses.append((float(terms.ce.detach()), float(terms.router_aux.detach())))
        return terms

    trainer.runtime.step, trainer.model.loss_terms = step, loss_terms
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps_logged] == list(range(1, steps + 1))
    t = cfg.train
    for i, r in enumerate(steps_logged):
        want = schedule_by_hand(i, t.lr, warmup, steps, t.min_lr_ratio, schedule, t.lr_decay_fraction)
        assert math.isclose(r["lr"], want, rel_tol=1e-12), (r["step"], r["lr"], want)
        assert norms[i] > 10 * t.grad_clip and math.isclose(r["grad_norm"], norms[i], rel_tol=1e-5)
        assert math.isclose(r["loss"], (losses[2 * i][0] + losses[2 * i + 1][0]) / 2, rel_tol=1e-6)
        assert math.isclose(r["aux_loss"], (losses[2 * i][1] + losses[2 * i + 1][1]) / 2, rel_tol=1e-6)
        assert r["skipped"] == 0
    if schedule == "wsd":
        assert [r["lr"] for r in steps_logged][-2:] == pytest.approx([t.lr, t.lr * (1 + t.min_lr_ratio) / 2])
    end = records[-1]
    assert end["event"] == "end" and end["status"] == "completed" and end["step"] == steps
    assert end["last_loss"] == steps_logged[-1]["loss"]


# -- defects ---------------------------------------------------------------------------------------------------
def test_eval_loss_is_the_token_weighted_mean_when_targets_hold_minus_100(tmp_path, data_dir, make_config):
    """Defect. README: an eval record holds "the token-weighted mean over the eval windows", "the same mean for any
    micro-batch size"; Transformer.loss leaves -100 targets out of its mean. Trainer.evaluate weighs each batch's
    mean by its number of windows (loop.py: `total[0] += ce.float() * x.shape[0]`), so with -100 targets a window
    of 1 scored token weighs as much as one of 32, and the eval loss moves with how the windows are batched.
    A user sees an eval loss that is neither the mean over the scored tokens nor stable across micro-batch sizes;
    they should see sum(token losses) / scored tokens, whatever the batching."""
    cfg = make_config(tmp_path, steps=1, warmup_steps=1, eval_interval=1, save_interval=0)
    cfg.train.device = "cpu"
    trainer = Trainer(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (3, 32), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (3, 32), generator=g)
    y[0, 1:] = -100  # window 0: one scored token; window 1: 8; window 2: all 32
    y[1, 8:] = -100
    try:
        model = trainer.model.eval()
        with torch.no_grad():
            logits, _ = model(x)
            per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                        ignore_index=-100, reduction="none")
        want = float(per_token.sum() / (y != -100).sum())
        got = {}
        for size in (1, 2, 3):  # micro-batch sizes: batches of at most `size` windows
            trainer.eval_data = [(x[i : i + size], y[i : i + size]) for i in range(0, 3, size)]
            got[size] = trainer.evaluate()
    finally:
        trainer.runtime.close()
        trainer._release_run_dir()
    assert all(math.isclose(v, want, rel_tol=1e-5) for v in got.values()), (got, want)
