"""LocalRuntime.step: global-norm clipping folded into torch's fused AdamW equals clip_grad_norm_ + AdamW."""

import copy

import pytest
import torch

from moe_train.config_io import build_config
from moe_train.model import Transformer
from moe_train.trainer.runtime import LocalRuntime
from moe_train.trainer.schedule import param_groups


@pytest.mark.parametrize("grad_clip,grad_size", [(1.0, 50.0), (1.0, 1e-4), (0.0, 50.0)])
def test_step_equals_clip_grad_norm_then_adamw(grad_clip, grad_size):
    cfg = build_config("tiny", overrides={"model.num_layers": 2, "model.d_model": 32, "model.num_heads": 2,
                                          "model.num_kv_heads": 1, "model.vocab_size": 64,
                                          "train.grad_clip": grad_clip})
    t = cfg.train
    runtime = LocalRuntime(cfg, torch.device("cpu"))
    model = runtime.setup(Transformer(cfg.model))
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(param_groups(ref_model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                foreach=False)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for p, q in zip(model.parameters(), ref_model.parameters()):
            grad = torch.randn(p.shape, generator=g) * grad_size
            p.grad, q.grad = grad.clone(), grad.clone()
        result = runtime.step(0.01)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), grad_clip if grad_clip > 0 else float("inf"))
        for group in ref_opt.param_groups:
            group["lr"] = 0.01
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert not result.skipped
        assert result.grad_norm == pytest.approx(float(ref_norm), rel=1e-5)
        if step == 0 and grad_clip > 0:  # the case this parametrisation is about: clipped or not
            assert (result.grad_norm > grad_clip) == (grad_size > 1)
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} after step {step}: {m}")
        assert all(p.grad is None for p in model.parameters())
