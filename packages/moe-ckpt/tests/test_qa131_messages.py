"""QA 131: arguments of the wrong kind to the public API are refused naming the argument, the value and what was
expected, before anything is written; each of these failed before on a missing attribute, an unorderable comparison
or "'NoneType' object is not callable", naming nothing."""

from __future__ import annotations

import os

import pytest
import torch
from moe_ckpt import (
    AsyncCheckpointer,
    LoadRequest,
    ShardSpec,
    apply_retention,
    fail_together,
    load_checkpoint,
    save_checkpoint,
    step_dir,
)
from moe_ckpt.hf import export_hf_folder

# the one-layer dense model and its tensors test_qa33_export_symlink.py exports
from test_qa33_export_symlink import MODEL, state as _state


def model_state() -> dict[str, torch.Tensor]:
    return _state(0)


@pytest.fixture
def saved(tmp_path):
    return save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("a", (2,), torch.arange(2.0)),
                                                   ShardSpec("b", (3,), torch.ones(3))])


def test_load_checkpoint_names_a_request_that_is_a_bare_tensor_name(saved):
    """Before: AttributeError: 'str' object has no attribute 'name'."""
    with pytest.raises(TypeError, match=r"requests\[0\] is a str \('a'\), expected a LoadRequest \(LoadRequest\('a'\)"):
        load_checkpoint(saved, ["a"])
    with pytest.raises(TypeError, match=r"requests\[1\] is a NoneType .*requests=None loads every tensor"):
        load_checkpoint(saved, [LoadRequest("a"), None])


def test_load_checkpoint_reads_a_generator_of_requests_instead_of_returning_nothing(saved):
    """Before: the requests were read twice, the checks emptied the generator and {} came back without a word."""
    got = load_checkpoint(saved, (LoadRequest(n) for n in ("a", "b")))
    assert sorted(got) == ["a", "b"] and torch.equal(got["a"], torch.arange(2.0))


def test_save_checkpoint_names_a_shard_that_is_not_a_shardspec_and_commits_nothing(tmp_path):
    """Before: AttributeError: 'Tensor' object has no attribute 'validate' (a dict: 'str' object ...)."""
    with pytest.raises(TypeError, match=r"shards\[1\] is a Tensor, expected a ShardSpec\(name, global_shape"):
        save_checkpoint(tmp_path / "x", [ShardSpec("a", (2,), torch.ones(2)), torch.ones(2)])
    with pytest.raises(TypeError, match=r"shards\[0\] is a str, .*a dict's key 'a'\? pass a list of ShardSpecs"):
        save_checkpoint(tmp_path / "y", {"a": torch.ones(2)})
    assert os.listdir(tmp_path) == []


def test_async_save_names_a_shard_that_is_not_a_shardspec(tmp_path):
    """Before: AttributeError: 'Tensor' object has no attribute 'writer', raised by wait()."""
    with AsyncCheckpointer() as ckpt:
        ckpt.save(tmp_path / "x", [torch.ones(2)])
        with pytest.raises(TypeError, match=r"shards\[0\] is a Tensor, expected a ShardSpec"):
            ckpt.wait()
    assert os.listdir(tmp_path) == []


def test_save_checkpoint_names_a_rank_or_keep_last_n_given_as_text(tmp_path):
    """Before: TypeError: '<=' not supported between instances of 'int' and 'str' (rank=os.environ["RANK"])."""
    shards = [ShardSpec("a", (2,), torch.ones(2))]
    with pytest.raises(ValueError, match=r"rank='0': expected an integer"):
        save_checkpoint(tmp_path / "x", shards, rank="0")
    with pytest.raises(ValueError, match=r"world_size='1': expected an integer"):
        save_checkpoint(tmp_path / "x", shards, world_size="1")
    with pytest.raises(ValueError, match=r"keep_last_n='2': expected an integer"):
        save_checkpoint(tmp_path / "x", shards, keep_last_n="2")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"keep_last_n='2': expected an integer"):
        apply_retention(tmp_path, "2")
    with pytest.raises(ValueError, match=r"keep_last_n=None: expected an integer"):
        apply_retention(tmp_path, None)


def test_fail_together_names_a_missing_all_reduce_sum_before_running_the_part():
    """Before: the part ran, then TypeError: 'NoneType' object is not callable."""
    ran = []
    with pytest.raises(TypeError, match=r"world_size=2 needs all_reduce_sum, a callable .*; got None"):
        fail_together(lambda: ran.append(1), 0, 2, None)
    assert ran == []


def test_export_hf_folder_names_a_source_or_tensor_of_the_wrong_kind_and_leaves_out_dir_alone(tmp_path):
    """Before: TypeError: 'list' object is not callable; AttributeError: 'numpy.ndarray' object has no attribute
    'detach'; AttributeError: 'NoneType' object has no attribute 'get' (model_config=None)."""
    out = tmp_path / "hf"
    with pytest.raises(TypeError, match=r"tensor source is a list, expected a Mapping of our tensor names to tensors"):
        export_hf_folder(MODEL, list(model_state().values()), out)
    state = model_state()
    state["embed.weight"] = state["embed.weight"].numpy()
    with pytest.raises(TypeError, match=r"tensor source gave a ndarray for 'embed.weight', expected a torch.Tensor"):
        export_hf_folder(MODEL, state, out)
    with pytest.raises(TypeError, match=r"model_config is a NoneType, expected moe-train's model config as a dict"):
        export_hf_folder(None, model_state(), out)
    assert os.listdir(tmp_path) == []
