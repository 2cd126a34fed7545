"""train.document_masking_kernel: the FlexAttention block mask against the dense document mask (on the CPU, where
FlexAttention runs forward only, eager) and the choice of kernel. The GPU's forward and backward are in
test_document_masking_gpu.py."""

import pytest
import torch
import torch.nn.functional as F

from moe_train.config import ConfigError, ModelConfig, RouterConfig, validate
from moe_train.config_io import config_from_dict
from moe_train.model import Transformer
from moe_train.model.attention import Attention
from moe_train.model.document_mask import (FLEX_BLOCK, attention_bias, document_attention_mask, document_block_mask,
                                           flex_document_attention_runs)
from moe_train.model.rope import rope_tables
from moe_precision import PrecisionRecipe

EOS = 3


def _tokens(b: int, s: int, seed: int, eos_every: float) -> torch.Tensor:
    """[b, s] ids in [4, 50) with EOS at random positions (about one in eos_every); row 0 ends in EOS and row 1
    starts with it when there are two rows, the last row (of three or more) has no EOS at all."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 50, (b, s), generator=g)
    tokens[torch.rand(b, s, generator=g) < 1 / eos_every] = EOS
    tokens[0, -1] = EOS
    if b > 1:
        tokens[1, 0] = EOS
    if b > 2:
        tokens[-1][tokens[-1] == EOS] = 4
    return tokens


def _listed(num: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """A BlockMask's (count, indices) pair as a [B, n, n] bool of the blocks it lists."""
    b = num.shape[0]
    out = torch.zeros(b, n, n, dtype=torch.bool)
    for i in range(b):
        for q in range(n):
            out[i, q, indices[i, 0, q, : num[i, 0, q]].long()] = True
    return out


@pytest.mark.parametrize("s", [1, 2, 127, 128, 129, 300, 515])
@pytest.mark.parametrize("eos_every", [2.5, 40.0, 400.0])
def test_the_block_mask_lists_exactly_the_blocks_the_dense_mask_needs(s, eos_every):
    tokens = _tokens(3, s, seed=s, eos_every=eos_every)
    dense = document_attention_mask(tokens, EOS)[:, 0]  # [B, S, S]
    block = document_block_mask(tokens, EOS)
    n = -(-s // FLEX_BLOCK)
    partial = _listed(block.kv_num_blocks, block.kv_indices, n)
    full = _listed(block.full_kv_num_blocks, block.full_kv_indices, n)
    assert not (partial & full).any()
    for q in range(n):
        for k in range(n):
            tile = dense[:, q * FLEX_BLOCK:(q + 1) * FLEX_BLOCK, k * FLEX_BLOCK:(k + 1) * FLEX_BLOCK]
            some, every = tile.flatten(1).any(1), tile.flatten(1).all(1)
            assert torch.equal(partial[:, q, k] | full[:, q, k], some), (q, k)  # nothing needed is skipped
            assert not (full[:, q, k] & ~every).any(), (q, k)  # a block run unmasked is wholly allowed
            if k < q:  # below the diagonal every wholly allowed block runs unmasked (the diagonal is never whole)
                assert torch.equal(full[:, q, k], every), (q, k)
    assert block.shape[-2:] == (s, s)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("s", [1, 129, 300])
def test_flex_attention_with_the_block_mask_matches_sdpa_with_the_dense_mask(dtype, s):
    cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2, qk_norm=True,
                      dense_hidden=64, num_experts=0)
    torch.manual_seed(0)
    attn = Attention(cfg, PrecisionRecipe()).to(dtype)
    x = torch.randn(2, s, cfg.d_model, dtype=dtype)
    cos, sin = rope_tables(s, cfg.resolved_head_dim, cfg.rope_theta, torch.device("cpu"), dtype)
    tokens = _tokens(2, s, seed=7, eos_every=20.0)
    with torch.no_grad():
        want = attn(x, cos, sin, attention_bias(document_attention_mask(tokens, EOS), dtype))
        got = attn(x, cos, sin, document_block_mask(tokens, EOS))
        causal = attn(x, cos, sin, None)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert float((got - want).abs().max()) < tol
    if s > 1:  # the mask matters here: causal attention reads across the documents
        assert float((causal - want).abs().max()) > 1e-3


def _model(head_dim: int = 16) -> Transformer:
    cfg = ModelConfig(vocab_size=64, d_model=4 * head_dim, num_layers=1, num_heads=4, num_kv_heads=4,
                      dense_hidden=32, num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2))
    return Transformer(cfg, device="meta")


def test_auto_takes_flex_on_a_gpu_where_it_runs_and_sdpa_elsewhere():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    model = _model()
    assert model.document_masking_path(cuda, torch.bfloat16) is None  # no document masking
    model.set_document_masking(EOS)
    assert model.document_mask_kernel == "auto"
    assert model.document_masking_path(cuda, torch.bfloat16) == "flex"
    assert model.document_masking_path(cuda, torch.float32) == "flex"
    assert model.document_masking_path(cuda, torch.float64) == "sdpa"
    assert model.document_masking_path(cpu, torch.float32) == "sdpa"
    assert _model(head_dim=24).document_masking_path(cuda, torch.bfloat16) is None
    odd = _model(head_dim=24)
    odd.set_document_masking(EOS)
    assert odd.document_masking_path(cuda, torch.bfloat16) == "sdpa"
    model.set_document_masking(EOS, "sdpa")
    assert model.document_masking_path(cuda, torch.bfloat16) == "sdpa"
    model.set_document_masking(EOS, "flex")
    assert model.document_masking_path(cuda, torch.bfloat16) == "flex"
    with pytest.raises(ValueError, match=r"document_masking_kernel='flex'.*cpu.*'auto' or 'sdpa'"):
        model.document_masking_path(cpu, torch.float32)
    odd.set_document_masking(EOS, "flex")
    with pytest.raises(ValueError, match="head_dim=24"):
        odd.document_masking_path(cuda, torch.bfloat16)
    with pytest.raises(ValueError, match=r"kernel='flash'.*auto, flex, sdpa"):
        model.set_document_masking(EOS, "flash")
    assert [flex_document_attention_runs(cuda, torch.bfloat16, d) for d in (8, 16, 64, 128, 256)] == \
        [False, True, True, True, False]


def test_a_cpu_forward_with_the_sdpa_and_auto_kernels_is_the_same():
    torch.manual_seed(0)
    model = Transformer(_model().cfg)
    tokens = _tokens(2, 40, seed=1, eos_every=8.0)
    model.set_document_masking(EOS, "sdpa")
    sdpa = model(tokens)[0]
    model.set_document_masking(EOS, "auto")
    assert torch.equal(model(tokens)[0], sdpa)
    model.set_document_masking(EOS, "flex")
    with pytest.raises(ValueError, match="document_masking_kernel='flex'"):
        model(tokens)


def test_the_config_refuses_an_unknown_kernel():
    with pytest.raises(ConfigError, match="train.document_masking_kernel"):
        validate(config_from_dict({"train": {"document_masking_kernel": "flash"}}))
    assert validate(config_from_dict({"train": {"document_masking_kernel": "flex"}})).train.document_masking_kernel \
        == "flex"


def test_sdpa_with_the_dense_mask_is_what_flex_is_checked_against():
    """The reference the flex test compares to: SDPA with the additive mask equals attention written out."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 50, 8, generator=g, dtype=torch.float64) for _ in range(3))
    tokens = _tokens(2, 50, seed=3, eos_every=6.0)
    mask = document_attention_mask(tokens, EOS)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias(mask, torch.float64))
    assert float((got - want).abs().max()) < 1e-12
