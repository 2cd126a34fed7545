import json

import pytest
import torch
from ckpt_cases import bits_equal, check_load, make_state, requests_for, run_ranks, shards_for

from moe_ckpt import (
    AsyncCheckpointer,
    Box,
    FlatRange,
    LoadRequest,
    ShardSpec,
    capture_rng_state,
    find_latest,
    inspect_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_metadata,
    restore_rng_state,
    save_checkpoint,
    step_dir,
)


def save_sim(path, state, world, metadata=None, **kw):
    """Save `state` as `world` simulated ranks (threads) in the training layout."""
    run_ranks(world, lambda r, bar: save_checkpoint(path, shards_for(state, r, world), metadata, r, world, bar, **kw))


def test_round_trip_one_writer_is_bit_identical(tmp_path):
    state = make_state()
    path = save_checkpoint(step_dir(tmp_path, 1), shards_for(state, 0, 1), {"step": 1})
    got = load_checkpoint(path)
    assert set(got) == set(state)
    for name, t in state.items():
        assert bits_equal(got[name], t), name
    files = sorted(p.name for p in path.iterdir())
    assert files == ["index.json", "metadata.json", "shard-00000-of-00001.safetensors"]


@pytest.mark.parametrize("save_world", [2, 4])
@pytest.mark.parametrize("load_world,style", [(1, "whole"), (3, "dim0"), (4, "dim0"), (2, "flat"), (5, "flat")])
def test_save_under_one_layout_load_under_another(tmp_path, save_world, load_world, style):
    state = make_state(save_world)
    save_sim(tmp_path / "ck", state, save_world)
    for r in range(load_world):
        reqs = requests_for(r, load_world, style)
        check_load(state, load_checkpoint(tmp_path / "ck", reqs), reqs)


def test_each_rank_writes_only_its_own_slices(tmp_path):
    from safetensors import safe_open

    state = make_state()
    save_sim(tmp_path / "ck", state, 2)
    with safe_open(tmp_path / "ck" / "shard-00001-of-00002.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "experts.w1[4:8,0:6,0:5]" in keys and "attn.w[0:7,0:5]" not in keys  # replicated: rank 0 writes
    assert f"opt.exp_avg.attn.wflat[18:35]" in keys


def test_flat_request_straddling_pieces_of_a_box_layout(tmp_path):
    t = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    shards = lambda r: [ShardSpec("t", (2, 3, 4), t[:, :, 2 * r : 2 * r + 2], Box((0, 0, 2 * r), (2, 3, 2)))]
    run_ranks(2, lambda r, bar: save_checkpoint(tmp_path / "ck", shards(r), None, r, 2, bar))
    got = load_checkpoint(tmp_path / "ck", [LoadRequest("t", region=FlatRange(5, 13))])
    assert torch.equal(got["t"], t.reshape(-1)[5:18])
    got = load_checkpoint(tmp_path / "ck", [LoadRequest("t", region=Box((1, 1, 1), (1, 2, 3)))])
    assert torch.equal(got["t"], t[1:2, 1:3, 1:4])


def test_load_into_out_fills_it_in_place(tmp_path):
    state = make_state()
    save_sim(tmp_path / "ck", state, 2)
    out = torch.zeros(4, 6, 5)
    got = load_checkpoint(tmp_path / "ck", [LoadRequest("experts.w1", region=Box.dim0((8, 6, 5), 4, 4), out=out)])
    assert got["experts.w1"] is out and bits_equal(out, state["experts.w1"][4:8])


@pytest.mark.parametrize("region", [FlatRange(5, 12), Box((0, 1, 0), (2, 2, 3))], ids=["flat", "box"])
def test_load_into_a_strided_out_fills_it_in_place(tmp_path, region):
    """flat: a transposed [3, 4] `out` for a 12-element range; the assembly's `out.view(-1)` raised torch's
    "view size is not compatible" error. box: a permuted `out` of the box's own shape (read before too).
    Both read across the two ranks' pieces, so the assembly path runs."""
    t = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    shards = lambda r: [ShardSpec("t", (2, 3, 4), t[:, :, 2 * r : 2 * r + 2], Box((0, 0, 2 * r), (2, 3, 2)))]
    run_ranks(2, lambda r, bar: save_checkpoint(tmp_path / "ck", shards(r), None, r, 2, bar))
    want = t.reshape(-1)[5:17] if isinstance(region, FlatRange) else t[:, 1:3, 0:3]
    out = torch.zeros(4, 3).t() if isinstance(region, FlatRange) else torch.zeros(3, 2, 2).permute(2, 1, 0)
    got = load_checkpoint(tmp_path / "ck", [LoadRequest("t", region=region, out=out)])["t"]
    assert got is out and torch.equal(out.reshape(-1), want.reshape(-1))


def test_out_may_be_a_parameter_and_a_wrong_or_expanded_out_is_refused_before_any_is_filled(tmp_path):
    """An nn.Parameter as `out` failed with torch's "a leaf Variable that requires grad is being used in an
    in-place operation"; an expanded buffer with torch's overlap error; a (3, 2) buffer for a (2, 3) box was
    filled in row-major order without a word."""
    w, v = torch.arange(6.0).reshape(2, 3), torch.arange(4.0)
    save_checkpoint(tmp_path / "ck", [ShardSpec("w", (2, 3), w), ShardSpec("v", (4,), v)])
    param = torch.nn.Parameter(torch.zeros(2, 3))
    got = load_checkpoint(tmp_path / "ck", [LoadRequest("w", out=param)])["w"]
    assert got is param and torch.equal(param.detach(), w) and param.requires_grad
    for bad, message in ((torch.zeros(1, 3).expand(2, 3), r"strides \(0, 1\): elements share memory"),
                         (torch.zeros(3, 2), r"out has \(3, 2\) torch.float32, needs \(2, 3\)")):
        first = torch.zeros(4)
        with pytest.raises(ValueError, match=message):
            load_checkpoint(tmp_path / "ck", [LoadRequest("v", out=first), LoadRequest("w", out=bad)])
        assert not first.any()  # refused before any request was filled


def test_metadata_and_rng_state_round_trip_through_json(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(9)
    rng = capture_rng_state()
    expect = (torch.rand(3), np.random.rand(3), random.random())
    meta = {"step": 7, "lr_schedule": {"last_epoch": 7}, "sampler": {"epoch": 0, "index": 4096},
            "rng": rng, "config": {"d_model": 64}, "layout": {"dp": 2, "ep": 2}}
    save_sim(tmp_path / "ck", make_state(), 2, meta)
    back = load_metadata(tmp_path / "ck")
    assert back["layout"] == {"dp": 2, "ep": 2} and back["moe_ckpt"]["writer_world_size"] == 2
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    restore_rng_state(back["rng"])
    assert torch.equal(torch.rand(3), expect[0])
    assert np.array_equal(np.random.rand(3), expect[1]) and random.random() == expect[2]
    info = inspect_checkpoint(tmp_path / "ck")
    assert info["tensors"]["experts.w1"] == {"shape": [8, 6, 5], "dtype": "float32",
                                             "pieces": ["shard-00000-of-00002.safetensors:[0:4,0:6,0:5]",
                                                        "shard-00001-of-00002.safetensors:[4:8,0:6,0:5]"]}
    assert info["metadata"]["step"] == 7 and info["world_size"] == 2
    json.dumps(info)


def test_async_save_equals_sync_save_and_reports_stall_and_write_time(tmp_path):
    state = make_state()
    save_checkpoint(tmp_path / "sync", shards_for(state, 0, 1), {"step": 1})
    ck = AsyncCheckpointer()
    ck.save(tmp_path / "async", shards_for(state, 0, 1), {"step": 1})
    for t in state.values():  # the snapshot was taken: later updates must not leak into the file
        t.zero_() if t.dtype != torch.bool else None
    stats = ck.wait()
    assert stats.stall_s > 0 and stats.write_s > 0 and stats.bytes > 0
    a, b = load_checkpoint(tmp_path / "sync"), load_checkpoint(tmp_path / "async")
    assert all(bits_equal(a[n], b[n]) for n in a) and not torch.equal(b["attn.w"], torch.zeros(7, 5))
    # the same files, but for metadata.json's saved_at (whole seconds: the two saves can straddle one, which made
    # this test fail now and then on the metadata file's checksum in index.json)
    ia, ib = (json.loads((tmp_path / d / "index.json").read_text()) for d in ("sync", "async"))
    assert ia.pop("metadata_file")["bytes"] == ib.pop("metadata_file")["bytes"]
    assert ia == ib
    ma, mb = (json.loads((tmp_path / d / "metadata.json").read_text()) for d in ("sync", "async"))
    assert ma["moe_ckpt"].pop("saved_at") and mb["moe_ckpt"].pop("saved_at")
    assert ma == mb


def test_async_save_error_surfaces_on_next_wait(tmp_path):
    ck = AsyncCheckpointer()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken.tmp").write_text("a file where the tmp dir must go")
    ck.save(tmp_path / "taken2", [ShardSpec("x", (2,), torch.ones(2))])
    ck.wait()
    ck.save(tmp_path / "taken2", [ShardSpec("x", (2,), torch.ones(2))])  # exists now -> background error
    with pytest.raises(FileExistsError, match="taken2"):
        ck.wait()
    assert ck.wait() is not None  # the error is raised once


def test_a_failed_async_save_does_not_become_last_stats(tmp_path):
    """wait() after a failed save returned that save's stats, which read as a success."""
    ck = AsyncCheckpointer()
    ck.save(tmp_path / "a", [ShardSpec("x", (2,), torch.ones(2))])
    assert ck.wait().bytes == 8
    ck.save(tmp_path / "a", [ShardSpec("x", (3,), torch.ones(3))])  # "a" exists: fails in the background
    with pytest.raises(FileExistsError):
        ck.wait()
    assert ck.wait().bytes == 8 and ck.last_stats.bytes == 8


def test_retention_keeps_the_last_n_and_latest_points_at_the_newest(tmp_path):
    state = make_state()
    for step in range(1, 6):
        save_checkpoint(step_dir(tmp_path, step), shards_for(state, 0, 1), {"step": step}, keep_last_n=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    assert find_latest(tmp_path) == step_dir(tmp_path, 5)
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    assert load_metadata(tmp_path)["step"] == 5  # a run directory resolves to its latest


def test_find_latest_of_an_empty_run_is_none(tmp_path):
    assert find_latest(tmp_path) is None and find_latest(tmp_path / "absent") is None


def test_a_pointer_left_behind_by_a_crash_yields_to_the_newer_complete_checkpoint(tmp_path):
    """A crash between a checkpoint's rename and the pointer update leaves `latest` one behind:
    the newer committed checkpoint is the one to resume from (not a retrain over it)."""
    state = make_state()
    for step in (4, 8):
        save_checkpoint(step_dir(tmp_path, step), shards_for(state, 0, 1), {"step": step})
    (tmp_path / "latest").write_text("step-00000004\n")
    assert find_latest(tmp_path) == step_dir(tmp_path, 8)
    (step_dir(tmp_path, 8) / "index.json").unlink()  # no longer complete: the pointer's target stands
    assert find_latest(tmp_path) == step_dir(tmp_path, 4)
