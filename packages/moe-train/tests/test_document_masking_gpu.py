"""train.document_masking on a GPU: both kernels (FlexAttention with the block mask, what "auto" takes here, and
scaled_dot_product_attention with the additive mask, another kernel than is_causal), in fp32 and under bf16
autocast, give a packed document the logits it gets alone; the two give the same loss and gradients, eager, under
train.compile and with activation checkpointing."""

import pytest
import torch
from attention_parity import compare_kernels, loss_and_grads

from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EOS = 7


@cuda
@pytest.mark.parametrize("kernel", ["flex", "sdpa"])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_packed_document_reads_as_it_does_alone_on_the_gpu(bf16, kernel):
    cfg = ModelConfig(vocab_size=1001, d_model=256, num_layers=2, num_heads=8, num_kv_heads=2, qk_norm=True,
                      dense_hidden=512, num_experts=8, expert_hidden=128, router=RouterConfig(top_k=2))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    model.set_document_masking(EOS, kernel)
    assert model.document_masking_path(torch.device("cuda"), torch.bfloat16 if bf16 else torch.float32) == kernel
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(8, 1001, (n,), generator=g) for n in (300, 517, 200)]
    eos = torch.tensor([EOS])
    packed = torch.cat([docs[0], eos, docs[1], eos, docs[2]]).unsqueeze(0).cuda()
    alone = torch.cat([docs[1], eos]).unsqueeze(0).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        got = model(packed)[0][0, 301:819].float()
        want = model(alone)[0][0].float()
    err = float((got - want).norm() / want.norm())
    assert err < (2e-2 if bf16 else 1e-5), err
    model.set_document_masking(None)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        unmasked = model(packed)[0][0, 301:819].float()
    assert float((unmasked - want).norm() / want.norm()) > 10 * err  # the mask is what makes them equal


@cuda
@pytest.mark.parametrize("setting", ["eager", "compile", "checkpointing"])
@pytest.mark.parametrize("bf16", [False, True])
def test_flex_and_sdpa_give_the_same_loss_and_gradients(bf16, setting):
    """Odd length (301 tokens: the last block padded), grouped-query heads, documents of every length from 1 up, a
    row with no eos at all; every parameter's gradient compared."""
    cfg = ModelConfig(vocab_size=503, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                      dense_hidden=512, num_experts=8, expert_hidden=128, router=RouterConfig(top_k=2),
                      dense_layers=[0])
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    if setting == "compile":
        model.set_compile(True)
    if setting == "checkpointing":
        model.set_activation_checkpointing("full")
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(8, 503, (3, 302), generator=g)
    tokens[torch.rand(3, 302, generator=g) < 0.02] = EOS
    tokens[0, 150:153] = EOS  # documents of one token
    tokens[2][tokens[2] == EOS] = 9  # one document over the whole window
    result = compare_kernels(model, tokens.cuda(), bf16, EOS)
    loss_s, loss_f = result.losses["sdpa"], result.losses["flex"]
    assert abs(loss_f - loss_s) < (2e-2 if bf16 else 1e-5) * abs(loss_s)
    assert not result.failures(), result.failures()


@cuda
def test_new_documents_each_step_reuse_the_compiled_flex_kernel():
    """Each forward builds a new BlockMask (a new mask_mod closure over that batch's document ids): the compiled
    flex_attention must serve them all from its first compile, not recompile per batch (torch.compile's
    recompile limit would then drop it to the eager kernel, which holds every score)."""
    from torch._dynamo.utils import counters

    cfg = ModelConfig(vocab_size=503, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, dense_hidden=512,
                      num_experts=8, expert_hidden=128, router=RouterConfig(top_k=2))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    model.set_document_masking(EOS, "flex")
    g = torch.Generator().manual_seed(3)

    def step() -> None:
        tokens = torch.randint(8, 503, (2, 513), generator=g)
        tokens[torch.rand(2, 513, generator=g) < 0.01] = EOS
        loss_and_grads(model, tokens.cuda(), bf16=True)

    step()
    compiled = dict(counters["stats"])
    for _ in range(4):
        step()
    assert dict(counters["stats"]) == compiled, (compiled, dict(counters["stats"]))
