"""train.compile on a GPU: the compiled model (attention, norms, dense SwiGLU, final norm and cross-entropy under
torch.compile; the MoE layers eager on the Triton / grouped_mm kernels) computes eager's loss and gradients in fp32,
and under bf16 autocast is as close to the fp32 truth as the eager model is; the rope kernel and the weight-cast Function stay
out of the graphs (no graph break), and the layers share their graphs.

Run on the device: PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 -m pytest -m gpu packages/moe-train/tests/test_compile_gpu.py
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import small_config
from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer
from moe_train.trainer.loop import Trainer
from torch._dynamo.utils import counters

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def loss_and_grads(model, tokens, bf16):
    torch.manual_seed(1)  # random routing draws the same routes in every pass
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:].contiguous())
    (ce + aux).backward()
    return float(ce), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compiled_loss_and_grads(model, tokens, bf16):
    """loss_and_grads with the model compiled, left eager again afterwards."""
    model.set_compile(True)
    try:
        return loss_and_grads(model, tokens, bf16)
    finally:
        model.set_compile(False)


def model_and_tokens(num_layers: int, routing: str = "learned"):
    cfg = ModelConfig(vocab_size=1000, d_model=256, num_layers=num_layers, num_heads=4, num_kv_heads=2, qk_norm=True,
                      rotary_fraction=0.5, dense_hidden=512, dense_layers=[0], num_experts=16, expert_hidden=128,
                      shared_expert_hidden=128, router=RouterConfig(top_k=4, routing=routing))
    torch.manual_seed(0)
    return Transformer(cfg).cuda(), torch.randint(0, 1000, (3, 78), device="cuda")  # 231 tokens: fits no block size


def test_compiled_model_gives_eager_fp32_loss_and_gradients():
    """fp32, no autocast: the compiled graphs compute what eager does, to fp32 rounding (a route near a tie could
    flip with it; at this size none does)."""
    model, tokens = model_and_tokens(3)
    eager_loss, eager = loss_and_grads(model, tokens, bf16=False)
    fast_loss, fast = compiled_loss_and_grads(model, tokens, bf16=False)
    assert abs(fast_loss - eager_loss) <= 1e-5 * abs(eager_loss)
    for name, g in eager.items():
        assert rel(fast[name], g) <= 1e-3, (name, rel(fast[name], g))


@pytest.mark.parametrize("num_layers", [2, 4])
def test_compiled_model_is_as_accurate_as_eager_under_bf16_autocast(num_layers):
    """Against the fp32 truth, the loss and every gradient as close as eager bf16's. Random routing (the same
    draws in every pass): with learned routing, bf16 rounding flips near-tie routes, differently in eager and
    compiled, and a flipped token moves its experts' and router's gradients by steps that measure the flips, not
    the arithmetic (the fp32 test above covers learned routing)."""
    model, tokens = model_and_tokens(num_layers, routing="random")
    truth_loss, truth = loss_and_grads(model, tokens, bf16=False)
    eager_loss, eager = loss_and_grads(model, tokens, bf16=True)
    torch._dynamo.reset()
    counters.clear()
    model.set_compile(True)
    for _ in range(2):  # compiling, then the compiled graphs alone
        fast_loss, fast = loss_and_grads(model, tokens, bf16=True)
        assert abs(fast_loss - truth_loss) <= 2 * abs(eager_loss - truth_loss) + 1e-2
        assert set(fast) == set(eager) == set(truth)
        for name, g in truth.items():
            err_eager, err_fast = rel(eager[name], g), rel(fast[name], g)
            assert err_fast <= 1.5 * err_eager + 1e-2, (name, err_fast, err_eager)
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 8, graphs  # attention, two norms, dense SwiGLU, final norm, cross-entropy: not per layer


@pytest.mark.parametrize("mode", ["full", "mlp"])
def test_compiled_model_under_activation_checkpointing_gives_eager_fp32_gradients(mode):
    """The recompute in backward runs the compiled modules again (and the MoE layers' kernels): fp32, the same
    checkpointed model eager and compiled, every gradient to fp32 rounding, and both as the model without it."""
    model, tokens = model_and_tokens(3)
    plain_loss, plain = loss_and_grads(model, tokens, bf16=False)
    model.set_activation_checkpointing(mode)
    eager_loss, eager = loss_and_grads(model, tokens, bf16=False)
    fast_loss, fast = compiled_loss_and_grads(model, tokens, bf16=False)
    assert abs(eager_loss - plain_loss) <= 1e-6 * abs(plain_loss)
    assert abs(fast_loss - eager_loss) <= 1e-5 * abs(eager_loss)
    for name, g in plain.items():
        assert rel(eager[name], g) <= 1e-5, (name, rel(eager[name], g))
        assert rel(fast[name], g) <= 1e-3, (name, rel(fast[name], g))


def test_trainer_compiled_on_the_gpu_resumes_onto_its_straight_run(tmp_path, data_dir):
    """The Trainer on the GPU (bf16 autocast) with train.compile, activation checkpointing and evals: 4 steps straight,
    and 2 steps + a new Trainer resuming from the step-2 checkpoint, log the same losses; an eager run logs losses
    within bf16 rounding of them. A constant learning rate, so the 2-step run's schedule is the 4-step run's."""
    def run(name: str, compile_: bool, steps: int) -> list[float]:
        cfg = small_config(tmp_path / name, steps=steps, save_interval=2, eval_interval=2, warmup_steps=1,
                           lr_schedule="constant", log_interval=1, grad_accum=1, device="cuda", compile=compile_,
                           activation_checkpointing="mlp")
        cfg.data.path = str(data_dir)
        Trainer(cfg).train()
        log = Path(cfg.train.run_dir) / "metrics.jsonl"
        return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]

    straight = run("straight", True, 4)
    run("resumed", True, 2)
    resumed = run("resumed", True, 4)
    eager = run("eager", False, 4)
    assert len(straight) == len(resumed) == len(eager) == 4
    for a, b in zip(resumed, straight):
        assert abs(a - b) <= 1e-4 * abs(b), (resumed, straight)
    for a, b in zip(straight, eager):
        assert abs(a - b) <= 2e-2 * abs(b), (straight, eager)
