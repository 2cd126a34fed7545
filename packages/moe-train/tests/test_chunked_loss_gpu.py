"""train.loss_chunk_tokens on a GPU: bf16 autocast, the fp32-output GEMM for the head weight's gradient, and the
peak memory the chunks exist for."""

import pytest
import torch

from moe_precision import PrecisionRecipe
from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer
from moe_train.model.chunked_loss import chunked_head_cross_entropy
from moe_train.model.transformer import cross_entropy

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _loss_and_grads(model, tokens, chunk, bf16):
    model.set_loss_chunk_tokens(chunk)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
    (ce + aux).backward()
    return float(ce.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@cuda
@pytest.mark.parametrize("z_weight", [0.0, 0.01])
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_model_loss_is_as_close_to_fp32_as_the_whole_logits_are(tie, z_weight):
    """Against the fp32 model (no autocast, whole logits): the chunked bf16 loss and every gradient are as close as
    the whole-logits bf16 ones are (within 1.5x their error, plus a small floor); with the LM head's z-loss too
    (train.lm_z_loss_weight: its gradient folded into the compiled chunk function's)."""
    cfg = ModelConfig(vocab_size=3001, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=512,
                      num_experts=8, expert_hidden=128, router=RouterConfig(top_k=2), tie_embeddings=tie)
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    model.set_lm_z_loss_weight(z_weight)
    tokens = torch.randint(0, 3001, (3, 101), device="cuda")  # 300 targets: 7 chunks of 47, the last of 18
    truth_loss, truth = _loss_and_grads(model, tokens, 0, bf16=False)
    plain_loss, plain = _loss_and_grads(model, tokens, 0, bf16=True)
    chunked_loss, chunked = _loss_and_grads(model, tokens, 47, bf16=True)
    assert abs(chunked_loss - truth_loss) <= 1.5 * abs(plain_loss - truth_loss) + 1e-3
    for name, want in truth.items():
        assert rel(chunked[name], want) <= 1.5 * rel(plain[name], want) + 2e-3, name
    head = "embed.weight" if tie else "lm_head.weight"  # tied: one parameter, named once
    assert rel(chunked[head], plain[head]) < 2e-2


@cuda
def test_chunked_loss_peak_memory_is_a_fraction_of_the_whole_logits():
    """4096 tokens, vocab 32,000: the whole logits' forward+backward holds [4096, V] in bf16 and fp32 and their
    gradients (~1.5 GB); chunks of 512 hold one chunk's and the head weight's fp32 gradient."""
    n, d, v = 4096, 512, 32_000
    torch.manual_seed(0)
    head = PrecisionRecipe("bf16").linear(d, v).cuda()
    h = torch.randn(n, d, device="cuda", requires_grad=True)
    targets = torch.randint(0, v, (n,), device="cuda")

    def peak(chunk: int) -> tuple[int, torch.Tensor]:
        h.grad = head.weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (chunked_head_cross_entropy(h, head.gemm_weight(h), targets, chunk) if chunk
                    else cross_entropy(head(h), targets))
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, loss.detach()

    whole, whole_loss = peak(0)
    chunked, chunked_loss = peak(512)
    assert whole > n * v * 6  # at least the bf16 logits and their fp32 copy
    assert chunked < 0.3 * whole, (chunked, whole)
    torch.testing.assert_close(chunked_loss, whole_loss, rtol=1e-4, atol=1e-4)
