"""model.sliding_window_pattern on a GPU: FlexAttention with the window's block mask (what "auto" takes here) and
scaled_dot_product_attention with the additive mask give the same loss and gradients, windows alone and with
train.document_masking, eager, under train.compile and with activation checkpointing; a window in the model changes
what it computes; new batches reuse the compiled kernel."""

import pytest
import torch

from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EOS = 7
PATTERN = [64, 200, 1, 0]  # windows under one block, over one, of one token, and a full layer


def _model(setting: str = "eager") -> Transformer:
    cfg = ModelConfig(vocab_size=503, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, qk_norm=True,
                      dense_hidden=512, num_experts=8, expert_hidden=128, router=RouterConfig(top_k=2),
                      dense_layers=[0], sliding_window_pattern=PATTERN)
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    if setting == "compile":
        model.set_compile(True)
    if setting == "checkpointing":
        model.set_activation_checkpointing("full")
    return model


def _tokens(seed: int, s: int = 302) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(8, 503, (3, s), generator=g)
    tokens[torch.rand(3, s, generator=g) < 0.02] = EOS
    tokens[0, 150:153] = EOS
    return tokens.cuda()


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, bf16: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
    (ce + aux).backward()
    return float(ce), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@cuda
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("setting", ["eager", "compile", "checkpointing"])
@pytest.mark.parametrize("bf16", [False, True])
def test_flex_and_sdpa_give_the_same_loss_and_gradients(bf16, setting, documents):
    model = _model(setting)
    tokens = _tokens(2)
    results = {}
    for kernel in ("sdpa", "flex"):
        model.set_document_masking(EOS if documents else None, kernel)
        assert model.document_masking_path(tokens.device, torch.bfloat16 if bf16 else torch.float32) == kernel
        results[kernel] = _loss_and_grads(model, tokens, bf16)
    (loss_s, grads_s), (loss_f, grads_f) = results["sdpa"], results["flex"]
    assert abs(loss_f - loss_s) < (2e-2 if bf16 else 1e-5) * abs(loss_s)
    tol = 3e-2 if bf16 else 2e-4
    for name, want in grads_s.items():
        err = float((grads_f[name] - want).norm() / want.norm().clamp_min(1e-12))
        assert err < tol, (name, err)
    model.set_document_masking(EOS if documents else None, "auto")
    model.cfg.sliding_window_pattern = []  # the same weights without windows compute another loss
    causal, _ = _loss_and_grads(model, tokens, bf16)
    model.cfg.sliding_window_pattern = PATTERN
    assert abs(causal - loss_s) > 1e-3 * abs(loss_s), (causal, loss_s)


@cuda
def test_new_batches_reuse_the_compiled_flex_kernel():
    from torch._dynamo.utils import counters

    model = _model()
    model.set_document_masking(EOS, "flex")
    seeds = iter(range(10, 20))

    def step() -> None:
        _loss_and_grads(model, _tokens(next(seeds), s=513), bf16=True)

    step()
    compiled = dict(counters["stats"])
    for _ in range(4):
        step()
    assert dict(counters["stats"]) == compiled, (compiled, dict(counters["stats"]))
