"""model.sliding_window_pattern: per-layer sliding-window attention (a window w: a token attends to itself and the w - 1
tokens before it, Hugging Face's sliding_window), alone and with train.document_masking, on the CPU: the dense mask
against a loop, the FlexAttention block mask against the dense mask (eager flex, forward only on the CPU), the
model's receptive field, the config field and the FLOP count. The GPU's forward and backward through FlexAttention
are in test_sliding_window_gpu.py; the Hugging Face export in test_hf_sliding_window.py."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from moe_train.config import Config, ConfigError, ModelConfig, RouterConfig, validate
from moe_train.config_io import config_from_dict
from moe_train.model import Transformer, flops_per_token
from moe_train.model.attention import Attention
from moe_train.model.document_mask import FLEX_BLOCK, attention_bias, attention_block_mask, attention_mask
from moe_train.model.rope import rope_tables
from moe_precision import PrecisionRecipe
from moe_train.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402

EOS = 3


def _tokens(b: int, s: int, seed: int, eos_every: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 50, (b, s), generator=g)
    tokens[torch.rand(b, s, generator=g) < 1 / eos_every] = EOS
    return tokens


def _loop_mask(tokens: torch.Tensor, eos_id: int | None, window: int) -> torch.Tensor:
    """The mask by its definition, one (query, key) pair at a time: [B, S, S]."""
    b, s = tokens.shape
    out = torch.zeros(b, s, s, dtype=torch.bool)
    for r in range(b):
        doc, docs = 0, []
        for t in tokens[r].tolist():
            docs.append(doc)
            doc += eos_id is not None and t == eos_id
        for q in range(s):
            for k in range(q + 1):
                out[r, q, k] = docs[q] == docs[k] and (window == 0 or q - k < window)
    return out


@pytest.mark.parametrize("window", [0, 1, 2, 5, 16, 36, 37, 60])
@pytest.mark.parametrize("eos_id", [None, EOS])
def test_the_dense_mask_is_the_definition(window, eos_id):
    tokens = _tokens(2, 37, seed=window, eos_every=6.0)
    got = attention_mask(tokens, eos_id, window)
    assert got.shape == ((1 if eos_id is None else 2), 1, 37, 37)
    assert torch.equal(got[:, 0].expand(2, 37, 37), _loop_mask(tokens, eos_id, window))


def _listed(num: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    b = num.shape[0]
    out = torch.zeros(b, n, n, dtype=torch.bool)
    for i in range(b):
        for q in range(n):
            out[i, q, indices[i, 0, q, : num[i, 0, q]].long()] = True
    return out


@pytest.mark.parametrize("s,window", [(1, 1), (129, 0), (129, 1), (300, 127), (300, 128), (300, 129), (515, 200),
                                      (515, 256), (515, 257), (700, 385), (640, 639)])
@pytest.mark.parametrize("eos_id", [None, EOS])
def test_the_block_mask_lists_exactly_the_blocks_the_dense_mask_needs(s, window, eos_id):
    tokens = _tokens(2, s, seed=s + window, eos_every=150.0)
    dense = attention_mask(tokens, eos_id, window)[:, 0]
    block = attention_block_mask(tokens, eos_id, window)
    n = -(-s // FLEX_BLOCK)
    partial = _listed(block.kv_num_blocks, block.kv_indices, n)
    full = _listed(block.full_kv_num_blocks, block.full_kv_indices, n)
    assert partial.shape[0] == dense.shape[0] == (1 if eos_id is None else 2)
    assert not (partial & full).any()
    for q in range(n):
        for k in range(n):
            tile = dense[:, q * FLEX_BLOCK:(q + 1) * FLEX_BLOCK, k * FLEX_BLOCK:(k + 1) * FLEX_BLOCK]
            some, every = tile.flatten(1).any(1), tile.flatten(1).all(1)
            assert torch.equal(partial[:, q, k] | full[:, q, k], some), (q, k)  # nothing needed is skipped
            assert not (full[:, q, k] & ~every).any(), (q, k)  # a block run unmasked is wholly allowed
            if k < q:
                assert torch.equal(full[:, q, k], every), (q, k)
    # mask_mod, where the kernel applies it, is the dense mask
    q_idx, kv_idx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    for r in range(dense.shape[0]):
        got = block.mask_mod(torch.tensor(r), torch.tensor(0), q_idx, kv_idx)
        assert torch.equal(got, dense[r])


@pytest.mark.parametrize("dtype,s,window,eos_id", [(torch.float64, 129, 1, None), (torch.float64, 300, 100, EOS),
                                                    (torch.float64, 300, 128, None), (torch.float32, 300, 100, None)])
def test_flex_attention_with_the_block_mask_matches_sdpa_with_the_dense_mask(dtype, s, window, eos_id):
    cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2, dense_hidden=64,
                      num_experts=0)
    torch.manual_seed(0)
    attn = Attention(cfg, PrecisionRecipe()).to(dtype)
    x = torch.randn(2, s, cfg.d_model, dtype=dtype)
    cos, sin = rope_tables(s, cfg.resolved_head_dim, cfg.rope_theta, torch.device("cpu"), dtype)
    tokens = _tokens(2, s, seed=7, eos_every=60.0)
    with torch.no_grad():
        want = attn(x, cos, sin, attention_bias(attention_mask(tokens, eos_id, window), dtype))
        got = attn(x, cos, sin, attention_block_mask(tokens, eos_id, window))
        wider = attn(x, cos, sin, attention_bias(attention_mask(tokens, eos_id, window + 1), dtype))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert float((got - want).abs().max()) < tol
    assert float((wider - want).abs().max()) > 1e-3  # one key more in the window changes the output


@pytest.mark.parametrize("eos_id", [None, EOS])
def test_compiled_flex_serves_every_window_size_from_one_compile(eos_id):
    """The block mask's mask_mod reads its window from a tensor: compiled flex_attention (what a GPU runs; forward
    only on the CPU) compiles once for windows of 3 sizes, not once per size (an int in the closure is guarded on,
    and with train and eval, dtypes and documents the recompile limit of 8 came within reach, past which flex
    runs eagerly and holds every score)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 256, 16, generator=g) for _ in range(3))
    tokens = _tokens(2, 256, seed=3, eos_every=50.0)
    new_graphs = []
    for window in (5, 130, 37):
        counters.clear()
        with torch.no_grad():
            got = compiled(q, k, v, block_mask=attention_block_mask(tokens, eos_id, window))
        new_graphs.append(counters["stats"].get("unique_graphs", 0))
        mask = attention_mask(tokens, eos_id, window)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert float((got - want).abs().max()) < 1e-5, window
    assert new_graphs == [1, 0, 0], new_graphs


def _model(pattern: list[int], num_layers: int = 3, **extra) -> Transformer:
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=num_layers, num_heads=4, num_kv_heads=2, dense_hidden=32,
                      num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2), sliding_window_pattern=pattern,
                      **extra)
    torch.manual_seed(0)
    return Transformer(cfg).double().eval()


@pytest.mark.parametrize("pattern,reach", [([4], 9), ([1, 4, 2], 4), ([3, 0], None), ([5, 5, 0], None)])
def test_a_token_sees_exactly_its_receptive_field(pattern, reach):
    """Through L layers of windows w_i a query sees sum(w_i - 1) tokens back, no further (None: a full layer, all of
    them). Changing the token just past that reach changes nothing at the query; the token at it changes it."""
    model = _model(pattern)
    s, q = 24, 20
    tokens = _tokens(1, s, seed=1, eos_every=1e9)
    with torch.no_grad():
        base = model(tokens)[0][0, q]
        for back in sorted({1, q // 2, q} | (set() if reach is None else {reach, reach + 1})):
            changed = tokens.clone()
            changed[0, q - back] = 4 + (int(changed[0, q - back]) - 3) % 40
            moved = float((model(changed)[0][0, q] - base).abs().max())
            if reach is None or back <= reach:
                assert moved > 1e-8, (back, moved)
            else:  # float64 round-off only: the experts' GEMMs see other rows beside the query's
                assert moved < 1e-13, (back, moved)


def test_a_window_over_the_sequence_and_zeros_are_plain_causal_attention():
    tokens = _tokens(2, 19, seed=2, eos_every=1e9)
    with torch.no_grad():
        causal = _model([])(tokens)[0]
        assert torch.equal(_model([0])(tokens)[0], causal)
        assert torch.equal(_model([19, 0, 50])(tokens)[0], causal)  # windows >= S take the causal kernel too
        assert not torch.equal(_model([18])(tokens)[0], causal)
    assert [_model([4, 0]).cfg.attention_window(i) for i in range(3)] == [4, 0, 4]


def test_windows_and_documents_restrict_attention_together():
    model = _model([4, 6, 0])
    tokens = _tokens(2, 40, seed=3, eos_every=7.0)
    layers = model._attention_masks(tokens, torch.float64)
    for i, w in enumerate([4, 6, 0]):
        assert layers[i] is None if w == 0 else torch.equal(layers[i] == 0, attention_mask(tokens, None, w))
    model.set_document_masking(EOS, "sdpa")
    layers = model._attention_masks(tokens, torch.float64)
    assert layers[0] is not layers[1] and layers[0] is layers[0]
    for i, w in enumerate([4, 6, 0]):
        assert torch.equal(layers[i] == 0, attention_mask(tokens, EOS, w))
    # a whole run's loss and gradients are finite and reach every parameter through the windowed layers
    model.train()
    ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
    (ce + aux).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_the_path_covers_windowed_layers_without_documents():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    plain, windowed = _model([]), _model([4, 0])
    assert plain.document_masking_path(cuda, torch.bfloat16) is None
    assert windowed.document_masking_path(cuda, torch.bfloat16) == "sdpa"  # head_dim 8: FlexAttention does not run
    wide = Transformer(ModelConfig(vocab_size=64, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                   num_experts=0, sliding_window_pattern=[8]), device="meta")
    assert wide.document_masking_path(cuda, torch.bfloat16) == "flex"
    assert wide.document_masking_path(cpu, torch.float32) == "sdpa"
    wide.set_document_masking(None, "flex")
    with pytest.raises(ConfigError, match="document_masking_kernel='flex'"):
        wide.document_masking_path(cpu, torch.float32)


@pytest.mark.parametrize("bad", [[-1], [True], [2.5], ["wide"], 4096])
def test_a_bad_pattern_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match=r"model.sliding_window_pattern"):
        validate(config_from_dict({"model": {"sliding_window_pattern": bad}}))


def test_the_field_round_trips_and_the_trainer_trains_and_resumes_with_it(tmp_path, data_dir):
    cfg = config_from_dict({"model": {"sliding_window_pattern": [4096, 4096, 4096, 0]}})
    assert cfg.model.sliding_window_pattern == [4096, 4096, 4096, 0]
    assert config_from_dict(cfg.to_dict()).model.sliding_window_pattern == [4096, 4096, 4096, 0]
    assert validate(Config(model=ModelConfig(sliding_window_pattern=[]))).model.attention_window(3) == 0

    def run(name: str, pattern: list[int], steps: int) -> list[dict]:
        cfg = small_config(tmp_path, steps=steps, save_interval=2, eval_interval=2, activation_checkpointing="full",
                           run_dir=str(tmp_path / name))
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, sliding_window_pattern=pattern))
        with Trainer(cfg) as trainer:
            trainer.train()
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    windowed = run("windowed", [5, 0], 2)
    resumed = run("windowed", [5, 0], 4)  # the second run resumes the first's checkpoint
    causal = run("causal", [], 2)
    losses = [r["loss"] for r in windowed + resumed if "loss" in r]
    assert len(losses) >= 2 and all(torch.isfinite(torch.tensor(x)) for x in losses)
    assert [r["resumed_from_step"] for r in resumed if r.get("event") == "start"] == [None, 2]
    first_eval = [[r["eval_loss"] for r in rs if "eval_loss" in r][0] for rs in (windowed, causal)]
    assert first_eval[0] != first_eval[1]  # the same weights read through a window at step 0


def test_flops_count_the_keys_each_window_lets_a_token_read():
    full = ModelConfig(num_layers=2, num_heads=4, head_dim=16)
    per_layer = 6 * 4 * 16 * 1024  # a causal layer: 12 x heads x head_dim x S / 2 keys per token
    assert flops_per_token(full, 1024) - flops_per_token(ModelConfig(num_layers=2, num_heads=4, head_dim=16,
                                                                     sliding_window_pattern=[1024, 0]), 1024) == 0
    windowed = ModelConfig(num_layers=2, num_heads=4, head_dim=16, sliding_window_pattern=[256, 0])
    # the windowed layer reads 256 - 256^2 / (2 x 1024) = 224 keys per token on average, not 512
    assert flops_per_token(full, 1024) - flops_per_token(windowed, 1024) == per_layer - 12 * 4 * 16 * 224
