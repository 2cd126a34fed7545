"""broadcast_module_state on gloo ranks seeded differently: frozen parameters and buffers end as the first replica's.

3 ranks (one spawn): dp=3; a group of one; a buffer of another shape on one rank and a buffer on the meta device on
one rank, each refused on every rank at once. 4 ranks (one spawn): dp=2 pp=2, where each dp group takes its own first
rank's values; dp=4 ep=2, where expert slices (a frozen expert weight, a per-expert buffer) travel over expert-dp
only, so each ep rank keeps its own experts, and dense state over dp.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("module_state_worker")
parallel_spawn = importlib.import_module("parallel_spawn")

DEADLINE_S = 60
PROMPT_S = 4.0  # the checks' own timeout is 8 s: a rank that waited for another takes at least that long
DENSE_STATE = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "emb.weight", "mask", "empty", "scalar",
               "low", "transposed"}


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> list[dict]:
    return parallel_spawn.run_ranks(worker.run_rank, 3, tmp_path_factory.mktemp("module_state3"), DEADLINE_S)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return parallel_spawn.run_ranks(worker.run_rank, 4, tmp_path_factory.mktemp("module_state4"), DEADLINE_S)


def _equal(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in dtype, shape or any bit."""
    assert a.keys() == b.keys()
    return [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
            or not torch.equal(_bytes(a[n]), _bytes(b[n]))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _check_dense(results: list[dict], firsts: list[int]) -> None:
    """Rank r ends with the state rank firsts[r] started with; its trainable weights and per_rank stay its own."""
    for r, res in enumerate(results):
        after, source = res["after"], results[firsts[r]]["before"]
        assert set(after["state"]) == DENSE_STATE | {"per_rank"}
        assert _equal({n: after["state"][n] for n in DENSE_STATE}, {n: source["state"][n] for n in DENSE_STATE}) == []
        assert _equal(after["trainable"], res["before"]["trainable"]) == []
        assert torch.equal(after["state"]["per_rank"], torch.full((2,), float(r)))  # excluded
        assert after["state"]["transposed"].stride() == res["before"]["state"]["transposed"].stride()
    # the ranks really started different, so equal ends mean something
    for r in range(1, len(results)):
        if firsts[r] != r:
            before, source = results[r]["before"]["state"], results[firsts[r]]["before"]["state"]
            assert set(_equal(before, source)) == DENSE_STATE - {"empty"} | {"per_rank"}
            assert _equal(results[r]["before"]["trainable"], results[firsts[r]]["before"]["trainable"])


def test_frozen_parameters_and_buffers_of_every_dtype_end_as_the_first_ranks_over_dp3(three):
    _check_dense([r["dp3"] for r in three], firsts=[0, 0, 0])


def test_each_dp_group_takes_its_own_first_ranks_state_with_two_pipeline_stages(four):
    _check_dense([r["dp2_pp2"] for r in four], firsts=[0, 0, 2, 2])


def test_expert_slices_travel_over_expert_dp_and_each_ep_rank_keeps_its_own_experts(four):
    # dp=4 ep=2: ep groups {0, 1}, {2, 3}; edp groups {0, 2}, {1, 3}
    results = [r["dp4_ep2"] for r in four]
    expert = {"moe.experts.frozen", "moe.experts.usage"}
    dense = {"norm.weight", "norm.bias", "moe.router.temperature"}
    for r, res in enumerate(results):
        after = res["after"]["state"]
        assert set(after) == expert | dense
        assert after["moe.experts.frozen"].shape == (2, 2) and after["moe.experts.usage"].shape == (2,)
        assert _equal({n: after[n] for n in expert}, {n: results[r % 2]["before"]["state"][n] for n in expert}) == []
        assert _equal({n: after[n] for n in dense}, {n: results[0]["before"]["state"][n] for n in dense}) == []
        assert _equal(res["after"]["trainable"], res["before"]["trainable"]) == []
    for r in (2, 3):  # started different from their edp group's first rank
        assert set(_equal(results[r]["before"]["state"], results[r % 2]["before"]["state"])) == expert | dense
    # ranks 0 and 1 hold other experts: neither took the other's
    assert set(_equal(results[0]["after"]["state"], results[1]["after"]["state"])) == expert


def test_a_group_of_one_changes_nothing(three):
    for res in (r["group_of_one"] for r in three):
        assert _equal(res["after"]["state"], res["before"]["state"]) == []
        assert _equal(res["after"]["trainable"], res["before"]["trainable"]) == []


def test_a_buffer_of_another_shape_on_one_rank_is_refused_on_every_rank_at_once(three):
    for r in three:
        text, seconds = r["mismatch"]["outcome"], r["mismatch"]["seconds"]
        assert text.startswith("ValueError: broadcast_module_state: the frozen parameters and buffers differ across "
                               "ranks"), text
        assert "'bn.running_var' buffer (3,) torch.float32" in text and "'bn.running_var' buffer (4,)" in text, text
        assert 0 <= seconds < PROMPT_S, r["mismatch"]


def test_a_buffer_on_the_meta_device_on_one_rank_is_refused_on_every_rank_naming_it(three):
    mine = three[1]["meta_on_one_rank"]
    assert mine["outcome"].startswith("ValueError: broadcast_module_state got tensors on the meta device"), mine
    assert "['mask']" in mine["outcome"] and "to_empty" in mine["outcome"]
    for r in (0, 2):
        other = three[r]["meta_on_one_rank"]
        assert other["outcome"].startswith("ValueError: broadcast_module_state: the frozen parameters and buffers: rank "
                                           "1 refused them (ValueError: broadcast_module_state got tensors on the meta "
                                           "device"), other
        assert 0 <= other["seconds"] < PROMPT_S, other
