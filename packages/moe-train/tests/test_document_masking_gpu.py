"""train.document_masking on a GPU: the masked attention under bf16 autocast (scaled_dot_product_attention with a
boolean mask takes another kernel than is_causal) gives a packed document the logits it gets alone."""

import pytest
import torch

from moe_train.config import ModelConfig, RouterConfig
from moe_train.model import Transformer

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EOS = 7


@cuda
@pytest.mark.parametrize("bf16", [False, True])
def test_a_packed_document_reads_as_it_does_alone_on_the_gpu(bf16):
    cfg = ModelConfig(vocab_size=1001, d_model=256, num_layers=2, num_heads=8, num_kv_heads=2, qk_norm=True,
                      dense_hidden=512, num_experts=8, expert_hidden=128, router=RouterConfig(top_k=2))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    model.set_document_masking(EOS)
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
