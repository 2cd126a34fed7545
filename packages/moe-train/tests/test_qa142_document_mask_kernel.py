"""QA 142: train.document_masking_kernel (auto | flex | sdpa) of moe-train b332ea7, on the CPU.

Checked: the BlockMask of document_block_mask against the dense document mask and against torch's own
create_block_mask for adversarial layouts (an eos at every position, eos only at the block boundaries 127 / 128 /
129, one row, S a multiple of 128, S = 1..3, S = 2049 with two documents, rows that differ), element by element
(what flex computes: full blocks whole, partial blocks through mask_mod) and in the q direction (the lists backward
walks); flex forward against SDPA for every GQA ratio in fp32 and fp64 under no_grad and inference_mode; the whole
model's flex path (forced on the CPU) against its sdpa path, with eval batch sizes other than training's; the kernel
through deepcopy, pickle and a model pickled before the field; set_document_masking's argument errors; the field
through YAML and the command line; the trainer's and the bench's refusal of 'flex' on the CPU; the bench's
recorded path.

Found: 'flex' where it cannot run (any CPU run, a GPU run in fp64 or with head_dim 24) was refused with a plain
ValueError, which the CLI does not catch: `moe-train train --train.document_masking=true
--train.document_masking_kernel=flex` on a CPU ended in a Python traceback instead of the one-line
"moe-train: error: ..." and exit status 2 every other bad setting gives (bench alike). Fixed: document_masking_path
raises ConfigError (a ValueError, naming the field as before). Also: bench asked for the path after making its
runtime but outside the try whose finally closes it, so its refusal left the runtime (a torchrun job's process group)
open; the question now sits inside the try.
Held: everything else above (block lists element by element and in the q direction, torch's create_block_mask's
blocks, flex = SDPA to 1e-12 in fp64 for GQA 1 / 2 / 4, copies and old pickles, argument errors, YAML / CLI).
"""

from __future__ import annotations

import copy
import pickle
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn.attention.flex_attention import create_block_mask

from moe_precision import PrecisionRecipe
from moe_train.config import ConfigError, ModelConfig, RouterConfig
from moe_train.config_io import build_config
from moe_train.model import Transformer
from moe_train.model import transformer as transformer_module
from moe_train.model.attention import Attention
from moe_train.model.document_mask import (FLEX_BLOCK, attention_bias, document_attention_mask, document_block_mask,
                                           document_ids)
from moe_train.model.rope import rope_tables

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402

EOS = 3


def _row(s: int, eos_at=(), every: int = 0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(4, 50, (s,), generator=g)
    if every:
        row[every - 1::every] = EOS
    for p in eos_at:
        if p < s:
            row[p] = EOS
    return row


def _layouts() -> dict[str, torch.Tensor]:
    """Adversarial [B, S] token layouts."""
    return {
        "eos_everywhere_b1": torch.full((1, 300), EOS),
        "eos_everywhere_256": torch.full((2, 256), EOS),
        "boundaries_127_128_129": torch.stack([_row(384, (127,)), _row(384, (128,)), _row(384, (129,)),
                                               _row(384, (127, 128, 129))]),
        "boundaries_exact_256": torch.stack([_row(256, (127,)), _row(256, (128,)), _row(256, (255,))]),
        "s1": torch.tensor([[EOS], [5]]),
        "s2": torch.tensor([[EOS, EOS], [5, EOS], [EOS, 5], [5, 6]]),
        "s3": torch.tensor([[EOS, 5, EOS], [5, EOS, 6], [5, 6, 7]]),
        "long_2049_two_documents_b1": _row(2049, (1000,))[None],
        "long_2049_ends_in_eos": _row(2049, (2048,))[None],
        "rows_differ": torch.stack([torch.full((200,), EOS), _row(200), _row(200, every=7, seed=1),
                                    _row(200, (0, 199), seed=2)]),
        "block_of_one_document_between": _row(520, (60, 450))[None],
    }


LAYOUTS = _layouts()


def _effective(block, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S, S] bool: the (query, key) pairs flex attends with this BlockMask: full blocks whole, partial blocks
    where mask_mod allows, others not at all (what the kernels do)."""
    b, s = tokens.shape
    n = -(-s // FLEX_BLOCK)
    full = _listed(block.full_kv_num_blocks, block.full_kv_indices, n)
    partial = _listed(block.kv_num_blocks, block.kv_indices, n)
    assert not (full & partial).any()  # a block is run one way
    qi = torch.arange(s).view(1, s, 1)
    ki = torch.arange(s).view(1, 1, s)
    bi = torch.arange(b).view(b, 1, 1)
    mod = block.mask_mod(bi, torch.zeros_like(bi), qi, ki)
    up = lambda m: m.repeat_interleave(FLEX_BLOCK, 1).repeat_interleave(FLEX_BLOCK, 2)[:, :s, :s]  # noqa: E731
    return up(full) | (up(partial) & mod)


def _listed(num: torch.Tensor, indices: torch.Tensor, n: int, n_other: int | None = None) -> torch.Tensor:
    """A BlockMask's (count, indices) lists as a [B, n, n_other] bool of the blocks listed for each row block."""
    n_other = n if n_other is None else n_other
    b = num.shape[0]
    out = torch.zeros(b, n, n_other, dtype=torch.bool)
    for i in range(b):
        for r in range(n):
            cols = indices[i, 0, r, : num[i, 0, r]].long()
            assert len(set(cols.tolist())) == len(cols), "a block listed twice"
            out[i, r, cols] = True
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_block_mask_attends_exactly_the_dense_mask_and_matches_torchs_own(name):
    tokens = LAYOUTS[name]
    b, s = tokens.shape
    n = -(-s // FLEX_BLOCK)
    dense = document_attention_mask(tokens, EOS)[:, 0]
    block = document_block_mask(tokens, EOS)
    assert block.shape == (b, 1, s, s) or block.shape[-2:] == (s, s)
    assert torch.equal(_effective(block, tokens), dense), name

    ids = document_ids(tokens, EOS)

    def reference(b_idx, h_idx, q_idx, kv_idx):
        return (ids[b_idx, q_idx] == ids[b_idx, kv_idx]) & (q_idx >= kv_idx)

    theirs = create_block_mask(reference, b, 1, s, s, device="cpu", BLOCK_SIZE=FLEX_BLOCK)
    assert torch.equal(block.to_dense().bool(), theirs.to_dense().bool()), name  # the blocks run at all
    # the q-direction lists (backward's dk / dv walk): every block the kv lists name, and no other
    for kv_pair, q_pair in (((block.kv_num_blocks, block.kv_indices), (block.q_num_blocks, block.q_indices)),
                            ((block.full_kv_num_blocks, block.full_kv_indices),
                             (block.full_q_num_blocks, block.full_q_indices))):
        by_kv = _listed(*kv_pair, n)
        by_q = _listed(*q_pair, n)
        assert torch.equal(by_q, by_kv.transpose(1, 2)), name
    if s % FLEX_BLOCK == 0:  # no padding: the same partial / full split as torch's
        for ours, want in ((block.kv_num_blocks, theirs.kv_num_blocks),
                           (block.full_kv_num_blocks, theirs.full_kv_num_blocks),
                           (block.q_num_blocks, theirs.q_num_blocks),
                           (block.full_q_num_blocks, theirs.full_q_num_blocks)):
            assert torch.equal(ours.expand_as(want).int(), want.int()), name


def _attention(kv_heads: int, dtype: torch.dtype) -> Attention:
    cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=1, num_heads=4, num_kv_heads=kv_heads, qk_norm=True,
                      dense_hidden=64, num_experts=0)
    torch.manual_seed(kv_heads)
    return Attention(cfg, PrecisionRecipe()).to(dtype)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_flex_forward_matches_sdpa_for_every_gqa_ratio(kv_heads, dtype, mode):
    attn = _attention(kv_heads, dtype)
    tokens = LAYOUTS["boundaries_127_128_129"][:, :260]
    b, s = tokens.shape
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, 64, generator=g).to(dtype)
    cos, sin = rope_tables(s, attn.head_dim, 10000.0, torch.device("cpu"), dtype)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        want = attn(x, cos, sin, attention_bias(document_attention_mask(tokens, EOS), dtype))
        got = attn(x, cos, sin, document_block_mask(tokens, EOS))
        causal = attn(x, cos, sin, None)
    tol = 1e-12 if dtype == torch.float64 else 3e-6
    assert got.dtype == dtype and got.shape == want.shape
    assert float((got - want).abs().max()) < tol
    assert float((causal - want).abs().max()) > 1e-3  # the layout's documents matter


def _model(**changes) -> Transformer:
    fields = dict(vocab_size=61, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                  dense_hidden=48, dense_layers=[0], num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2))
    torch.manual_seed(0)
    return Transformer(ModelConfig(**(fields | changes)))


def _flex_on_the_cpu(monkeypatch):
    """flex_document_attention_runs as if the CPU ran FlexAttention (forward only, eager)."""
    monkeypatch.setattr(transformer_module, "flex_document_attention_runs", lambda device, dtype, head_dim: True)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_the_models_flex_path_gives_the_sdpa_logits_at_every_eval_batch_size(monkeypatch, kv_heads):
    _flex_on_the_cpu(monkeypatch)
    model = _model(num_kv_heads=kv_heads).double()
    model.set_document_masking(EOS, "auto")
    assert model.document_masking_path(torch.device("cpu"), torch.float64) == "flex"
    g = torch.Generator().manual_seed(5)
    train = torch.randint(4, 61, (4, 140), generator=g)
    train[:, 130] = EOS
    train[1, 127] = EOS
    with torch.no_grad():
        for tokens in (train, train[:1], train[1:], torch.randint(4, 61, (2, 40), generator=g)):
            model.set_document_masking(EOS, "flex")
            flex = model(tokens)[0]
            model.set_document_masking(EOS, "sdpa")
            sdpa = model(tokens)[0]
            assert float((flex - sdpa).abs().max()) < 1e-10, tokens.shape


def test_copies_keep_the_kernel_and_an_old_pickle_gets_sdpa():
    model = _model()
    model.set_document_masking(EOS, "auto")
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert (copied.document_eos_id, copied.document_mask_kernel) == (EOS, "auto")
    model.set_document_masking(EOS, "flex")
    assert pickle.loads(pickle.dumps(model)).document_mask_kernel == "flex"
    del model.__dict__["document_mask_kernel"]  # a model pickled before the field existed
    old = pickle.loads(pickle.dumps(model))
    assert old.document_mask_kernel == "sdpa" and old.document_eos_id == EOS
    assert old.document_masking_path(torch.device("cuda"), torch.bfloat16) == "sdpa"


@pytest.mark.parametrize("eos_id, kernel, match", [
    (EOS, None, r"kernel=None: expected one of auto, flex, sdpa"),
    (EOS, "FLEX", r"kernel='FLEX': expected one of auto, flex, sdpa"),
    (EOS, "", r"kernel='': expected one of"),
    (True, "auto", r"eos_id=True: expected a token id in \[0, model.vocab_size=61\)"),
    (61, "auto", r"eos_id=61"),
    (-1, "flex", r"eos_id=-1"),
    (3.0, "sdpa", r"eos_id=3.0"),
])
def test_set_document_masking_refuses_bad_arguments_and_keeps_the_setting(eos_id, kernel, match):
    model = _model()
    model.set_document_masking(7, "auto")
    with pytest.raises(ValueError, match=match):
        model.set_document_masking(eos_id, kernel)
    assert (model.document_eos_id, model.document_mask_kernel) == (7, "auto")


def test_flex_where_it_cannot_run_is_a_config_error_naming_the_field():
    model = _model(head_dim=24)
    model.set_document_masking(EOS, "flex")
    for device, dtype in ((torch.device("cpu"), torch.float32), (torch.device("cuda"), torch.float64),
                          (torch.device("cuda"), torch.bfloat16)):
        with pytest.raises(ConfigError, match=r"train.document_masking_kernel='flex'.*'auto' or 'sdpa'"):
            model.document_masking_path(device, dtype)
    model.set_document_masking(EOS, "auto")
    assert model.document_masking_path(torch.device("cuda"), torch.bfloat16) == "sdpa"  # head_dim 24


def test_the_field_round_trips_through_yaml_and_the_command_line(tmp_path):
    for kernel in ("auto", "flex", "sdpa"):
        cfg = build_config("tiny", None, {"train.document_masking_kernel": kernel, "train.document_masking": "true"})
        assert cfg.train.document_masking_kernel == kernel and cfg.train.document_masking is True
        path = tmp_path / f"{kernel}.yaml"
        path.write_text(yaml.safe_dump(cfg.to_dict()))
        again = build_config(None, str(path))
        assert again.to_dict() == cfg.to_dict()
    assert build_config("tiny").train.document_masking_kernel == "auto"  # the default
    for bad in ("flash", "none", "~", "Flex"):
        with pytest.raises(ConfigError, match="train.document_masking_kernel"):
            build_config("tiny", None, {"train.document_masking_kernel": bad})


def test_the_trainer_refuses_flex_on_the_cpu_before_any_run_folder_or_step(tmp_path, data_dir):
    from moe_train.trainer.loop import Trainer

    cfg = small_config(tmp_path, document_masking=True, document_masking_kernel="flex", device="cpu")
    with pytest.raises(ConfigError, match=r"train.document_masking_kernel='flex'.*cpu"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()
    cfg = small_config(tmp_path, steps=1, eval_interval=1, save_interval=0, document_masking=True,
                       document_masking_kernel="auto", device="cpu")
    with Trainer(cfg) as trainer:  # auto: sdpa here
        assert trainer.model.document_mask_kernel == "auto"
        trainer.train()
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_cli_refuses_flex_on_the_cpu_in_one_line(tmp_path, data_dir, capsys):
    from moe_train.cli import main

    args = [f"--data.path={data_dir}", f"--train.run_dir={tmp_path / 'run'}", "--train.device=cpu",
            "--train.document_masking=true", "--train.document_masking_kernel=flex", "--model.d_model=32",
            "--model.num_layers=2", "--data.seq_len=16", "--train.micro_batch_size=2", "--train.steps=1"]
    assert main(["train", "--preset", "tiny", *args]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("moe-train: warning:")]
    assert len(errors) == 1 and errors[0].startswith("moe-train: error: train.document_masking_kernel='flex'"), err
    assert not (tmp_path / "run").exists()


def test_the_bench_records_the_path_it_took_and_closes_its_runtime_when_it_refuses(tmp_path, monkeypatch):
    from moe_train.bench import run_bench
    from moe_train.trainer.runtime import LocalRuntime

    paths = {}
    for masking, kernel in ((False, "sdpa"), (True, "sdpa"), (True, "auto")):
        cfg = small_config(tmp_path, document_masking=masking, document_masking_kernel=kernel, grad_accum=1,
                           device="cpu")
        cfg.data.seq_len = 16
        result = run_bench(cfg, steps=1, warmup=0)
        assert result["document_masking"] is masking and result["document_masking_kernel"] == kernel
        paths[masking, kernel] = result["document_masking_path"]
    assert paths == {(False, "sdpa"): None, (True, "sdpa"): "sdpa", (True, "auto"): "sdpa"}
    cfg = small_config(tmp_path, document_masking=True, document_masking_kernel="flex", grad_accum=1, device="cpu")
    closed = []
    monkeypatch.setattr(LocalRuntime, "close", lambda self: closed.append(self))
    with pytest.raises(ConfigError, match="train.document_masking_kernel='flex'"):
        run_bench(cfg, steps=1, warmup=0)
    assert len(closed) == 1  # under torchrun its process group, which the refusal left open
