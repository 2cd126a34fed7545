"""QA pass 42: saves refused before anything is committed, on every rank alike; damaged index regions and
tokenizer files named; an HF export transformers cannot load refused; reads that later reads cannot see changed."""

from __future__ import annotations

import errno
import json
import os
import warnings

import pytest
import torch
from ckpt_cases import bits_equal, make_state, run_ranks, shards_for

import moe_ckpt.save
from moe_ckpt import (
    AsyncCheckpointer, Box, CorruptMetadataError, FlatRange, LoadRequest, ShardSpec, find_latest, list_checkpoints,
    load_checkpoint, open_checkpoint, save_checkpoint, step_dir,
)
from moe_ckpt.hf import HFConversionError, export_hf_folder
from moe_ckpt.hf.layout import build_plan


def _outcomes(world: int, save) -> list[str]:
    """Each rank's result of save(rank, barrier): 'ok' or 'ErrorType: message' (ranks are threads)."""
    def body(rank: int, barrier) -> str:
        try:
            save(rank, barrier)
            return "ok"
        except Exception as e:  # noqa: BLE001 - compared across ranks
            return f"{type(e).__name__}: {e}"
    return run_ranks(world, body)


def test_a_replicated_tensor_no_rank_writes_is_refused_on_every_rank_and_the_previous_checkpoint_stays(tmp_path):
    """Before, a tensor every rank handed in with writer=False was left out of index.json without a word: the save
    committed a checkpoint without it, found only at resume (TensorNotFoundError)."""
    w, b = torch.randn(4, 2), torch.randn(3)
    run_ranks(2, lambda r, bar: save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (4, 2), w, writer=r == 0),
                                                                         ShardSpec("b", (3,), b, writer=r == 0)],
                                                None, r, 2, bar))
    got = _outcomes(2, lambda r, bar: save_checkpoint(
        step_dir(tmp_path, 2), [ShardSpec("w", (4, 2), w, writer=r == 0), ShardSpec("b", (3,), b, writer=False)],
        None, r, 2, bar))
    assert got[0].startswith("LayoutError") and all("'b'" in g and "no rank wrote it" in g for g in got), got

    def async_save(r, bar):
        with AsyncCheckpointer() as ck:
            ck.save(step_dir(tmp_path, 3), [ShardSpec("w", (4, 2), w, writer=r == 0),
                                            ShardSpec("b", (3,), b, writer=False)], None, r, 2, bar)
    got = _outcomes(2, async_save)
    assert got[0].startswith("LayoutError") and all("no rank wrote it" in g for g in got), got
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]  # no tmp folder left
    assert bits_equal(load_checkpoint(find_latest(tmp_path))["b"], b)


def test_a_non_writer_that_disagrees_on_the_shape_is_refused_on_every_rank(tmp_path):
    got = _outcomes(2, lambda r, bar: save_checkpoint(
        step_dir(tmp_path, 1), [ShardSpec("w", (4, 2 + r), torch.zeros(4, 2 + r), writer=r == 0)], None, r, 2, bar))
    assert got[0].startswith("LayoutError") and all("(4, 3)" in g and "(4, 2)" in g for g in got), got
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("keep", [0, -1])
def test_an_invalid_keep_last_n_is_refused_on_every_rank_before_a_checkpoint_is_committed(tmp_path, keep):
    """Before, keep_last_n=0 was checked only by retention, after the commit, on rank 0: the checkpoint was
    committed, rank 0 raised ValueError and the other ranks returned, to wait at their next collective."""
    got = _outcomes(2, lambda r, bar: save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (2,), torch.ones(2),
                                                                                        writer=r == 0)],
                                                      None, r, 2, bar, keep_last_n=keep))
    assert all(g.startswith("ValueError") and f"keep_last_n={keep}" in g for g in got), got
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_name_containing_tmp_is_refused_before_anything_is_written(tmp_path):
    """Before, a save to `final.tmpl` wrote and renamed the whole checkpoint, then said it "was not committed: no
    error recorded", and every reader refused the folder as a partial save."""
    with pytest.raises(ValueError, match=r"final\.tmpl.*'\.tmp'"):
        save_checkpoint(tmp_path / "final.tmpl", [ShardSpec("w", (2,), torch.ones(2))])
    assert list(tmp_path.iterdir()) == []


def test_a_failure_after_the_commit_is_raised_on_every_rank_and_the_checkpoint_stays_loadable(tmp_path, monkeypatch):
    """Moving `latest` (or retention) fails on rank 0 after the rename: a full disk. Before, rank 0 raised and the
    other ranks returned as if all went well, to wait for rank 0 at their next collective."""
    def full_disk(root, checkpoint):
        raise OSError(errno.ENOSPC, "No space left on device", str(root / "latest"))

    w = torch.randn(4, 2)
    monkeypatch.setattr(moe_ckpt.save, "write_latest", full_disk)
    got = _outcomes(2, lambda r, bar: save_checkpoint(
        step_dir(tmp_path, 1), [ShardSpec("w", (4, 2), w, writer=r == 0)], None, r, 2, bar))
    assert got[0].startswith("OSError") and all("No space left on device" in g for g in got), got
    assert "was committed" in got[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]  # the error record is gone too
    assert bits_equal(load_checkpoint(tmp_path)["w"], w)


DENSE_5_HEADS_OF_2 = dict(  # moe-train's model fields: d_model 24 over 5 heads of head_dim 2 (q/k/v project to 10)
    vocab_size=51, d_model=24, num_layers=1, num_heads=5, num_kv_heads=5, head_dim=2, qk_norm=False,
    attention_bias=False, rope_theta=10000.0, rotary_fraction=1.0, norm_eps=1e-6, dense_hidden=16, dense_layers=[],
    num_experts=0, expert_hidden=0, shared_expert_hidden=0, shared_expert_gate=False, tie_embeddings=False,
    init_std=0.02)


def test_a_dense_model_whose_heads_do_not_divide_d_model_is_refused_as_llama_and_exports_as_qwen3(tmp_path):
    """Before, it exported as LlamaForCausalLM and transformers 5 refused the folder on load ("The hidden size (24)
    is not a multiple of the number of attention heads (5)"); Qwen3's config takes head_dim as given."""
    with pytest.raises(HFConversionError, match=r"num_heads=5 does not divide d_model=24.*qk_norm=True \(Qwen3"):
        export_hf_folder(DENSE_5_HEADS_OF_2, {}, tmp_path / "llama")
    assert not (tmp_path / "llama").exists()

    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    m = {**DENSE_5_HEADS_OF_2, "qk_norm": True}
    g = torch.Generator().manual_seed(0)
    source = {e.ours: torch.randn(e.our_shape, generator=g) for e in build_plan(m, "qwen3") if e.ours}
    export_hf_folder(m, source, tmp_path / "qwen3", dtype="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3", dtype=torch.float32)
    assert torch.equal(hf.model.layers[0].self_attn.q_proj.weight, source["blocks.0.attn.q_proj.weight"])


@pytest.mark.parametrize(("tensor", "region", "what"), [
    ("norm.b", {"flat": [0]}, "'flat' is not an integer pair"),  # was a bare IndexError
    ("norm.b", {"flat": [0, 2, 9]}, "'flat' is not an integer pair"),  # was read as [0, 2]
    ("attn.w", {"box": [[0, 7.0], [0, 5]]}, r"'box' is not a list of \[offset, length\] integer pairs"),  # rounded
])
def test_a_piece_region_that_is_not_integer_pairs_is_a_corrupt_metadata_error(tmp_path, tensor, region, what):
    ck = step_dir(tmp_path, 1)
    save_checkpoint(ck, shards_for(make_state(0), 0, 1))
    index = json.loads((ck / "index.json").read_text())
    piece = index["tensors"][tensor]["pieces"][0]
    piece.pop("box", None), piece.pop("flat", None), piece.update(region)
    (ck / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptMetadataError, match=rf"index.json is damaged \(ValueError: region .*{what}"):
        load_checkpoint(ck)


@pytest.mark.parametrize(("text", "what"), [
    ("{truncated", "is not valid JSON"),
    ("[]", "holds a JSON list, expected an object"),
    ('{"added_tokens": [{"content": "<eos>"}]}', "'added_tokens' is .* expected a list of"),
])
def test_a_damaged_tokenizer_json_is_refused_naming_it_before_any_tensor_is_read(tmp_path, text, what):
    """Before, it failed with a bare JSONDecodeError / AttributeError / KeyError after every shard was written."""
    read = []
    tok = tmp_path / "tokenizer.json"
    tok.write_text(text)
    m = {**DENSE_5_HEADS_OF_2, "qk_norm": True}
    with pytest.raises(HFConversionError, match=rf"{tok}:? .*{what}"):
        export_hf_folder(m, lambda name: read.append(name) or torch.zeros(0), tmp_path / "hf", tokenizer_json=tok)
    assert read == [] and sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]


def test_a_tensor_read_through_open_checkpoint_and_changed_in_place_leaves_later_reads_as_saved(tmp_path):
    """Before, a piece read whole came back as a view of the handle's memory map: adding to it in place changed what
    every later read of that piece through the same handle returned (the file itself stayed as saved)."""
    w, m = torch.randn(8, 4), torch.randn(12)
    ck = save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (8, 4), w),
                                                 ShardSpec("m", (12,), m, FlatRange(0, 12))])
    with open_checkpoint(ck) as ckpt:
        first = ckpt.read([LoadRequest("w"), LoadRequest("m", region=FlatRange(2, 6))])
        first["w"].add_(1.0), first["m"].zero_()  # e.g. a parameter that then trains
        again = ckpt.read([LoadRequest("w"), LoadRequest("m")])
        rows = ckpt.read([LoadRequest("w", region=Box((2, 0), (3, 4)))])["w"]
    assert bits_equal(again["w"], w) and bits_equal(again["m"], m) and bits_equal(rows, w[2:5])


@pytest.mark.parametrize("step", [-1, 2.0, True, "3"])
def test_step_dir_refuses_a_step_find_latest_could_never_list(tmp_path, step):
    with pytest.raises(ValueError, match=f"step={step!r}: expected an integer >= 0"):
        step_dir(tmp_path, step)
