"""A forward under inference_mode leaves the model trainable; second-order gradients through the fused rope."""

import os
import subprocess
import sys

import pytest
import torch

from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer


def small_model_config(**kw) -> ModelConfig:
    base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=48,
                dense_layers=[0], num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2))
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("mode", ["none", "full"])
def test_a_forward_under_inference_mode_leaves_the_model_trainable(mode):
    """An inference_mode forward first (a quick generation or eval) filled the rotary table cache with inference
    tensors; the next training forward saved them for backward and failed ("Inference tensors cannot be saved
    for backward"). The training step after it must be the one of a model that never ran under inference_mode."""
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))

    def grads(inference_first: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Transformer(small_model_config())
        model.set_activation_checkpointing(mode)
        if inference_first:
            with torch.inference_mode():
                model.eval()
                model(tokens[:, :-1])
                model.train()
        ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
        (ce + aux).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    want, got = grads(False), grads(True)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=lambda m: f"grad of {name}: {m}")


def test_fused_rope_backward_is_differentiable_under_the_triton_interpreter():
    """The fused kernel's backward (a rotation by -sin) ran the kernel outside autograd, so a second-order
    gradient through it (create_graph=True: Hessian-vector products, gradient penalties) silently lost the
    rotary term: half the Hessian-vector product below. It must equal the reference formula's."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    code = (
        "import torch, moe_train.model.rope as r\n"
        "assert r.triton_can_run_on(torch.zeros(1))\n"
        "g = torch.Generator().manual_seed(0)\n"
        "cos, sin = r.rope_tables(5, 8, 10000.0, torch.device('cpu'))\n"
        "x = torch.randn(1, 2, 5, 8, generator=g)\n"
        "v = torch.randn(1, 2, 5, 8, generator=g)\n"
        "def hvp(rope):\n"
        "    xx = x.clone().requires_grad_()\n"
        "    loss = (rope(xx, cos, sin) ** 3).sum() + (xx ** 3).sum()\n"
        "    grad, = torch.autograd.grad(loss, xx, create_graph=True)\n"
        "    return grad, torch.autograd.grad((grad * v).sum(), xx)[0]\n"
        "(g1, h1), (g2, h2) = hvp(r.apply_rope), hvp(r.rope_reference)\n"
        "torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-5)\n"
        "torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
