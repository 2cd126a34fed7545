"""Distributed training on CPU/gloo matches one process: DP2, EP2, DP4, DP2xEP2, EP4 (and the FSDP2 baseline).

fp32, grad_accum 2, 20 steps, the shrunk tiny preset; losses within 1e-5 relative, weights after
training within 1e-5 (relative to their scale). Also: no gradient collective on non-final
micro-batches, optimizer state per rank ~ 1/dp, invalid layouts fail with one message on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import test_parallel_harness as h  # noqa: E402

from moe_train.trainer.runtime import LocalRuntime  # noqa: E402

pytestmark = pytest.mark.slow
RTOL = 1e-5


@pytest.fixture(scope="module")
def tokens():
    return h.token_stream()


@pytest.fixture(scope="module")
def reference(tokens):
    cfg = h.shrunk_tiny(1, 1)
    torch.set_num_threads(1)
    res = h.train(cfg, LocalRuntime(cfg, torch.device("cpu")), tokens)
    return {"losses": res["losses"], "weights": {n: p.detach().clone() for n, p in res["model"].named_parameters()}}


def _spawn(worker, world: int, tokens, tmp_path_factory) -> list[dict]:  # noqa: ANN001
    out_dir = tmp_path_factory.mktemp(f"spawn{world}")
    h.start_ranks(h.run_guarded, args=(worker, str(out_dir), h.free_port(), tokens), nprocs=world)
    return h.load_results(out_dir, world)


def _spawn_guarded(worker, world, tokens, tmp_path_factory):  # noqa: ANN001, ANN202
    return _spawn(worker, world, tokens, tmp_path_factory)


@pytest.fixture(scope="module")
def two_ranks(tokens, tmp_path_factory):
    return _spawn_guarded(h.worker2, 2, tokens, tmp_path_factory)


@pytest.fixture(scope="module")
def four_ranks(tokens, tmp_path_factory):
    return _spawn_guarded(h.worker4, 4, tokens, tmp_path_factory)


def _check_matches(reference: dict, results: list[dict], key: str, rtol: float = RTOL) -> None:
    ref = torch.tensor(reference["losses"], dtype=torch.float64)
    for r, res in enumerate(results):
        got = torch.tensor(res[key]["losses"], dtype=torch.float64)
        assert len(got) == len(ref) >= 20
        rel = ((got - ref).abs() / ref.abs()).max().item()
        assert rel < rtol, f"{key} rank {r}: losses differ by {rel:.2e} relative\nref={ref.tolist()}\ngot={got.tolist()}"
    weights = h.assemble([res[key]["weights"] for res in results])
    assert set(weights) == set(reference["weights"])
    for name, want in reference["weights"].items():
        got = weights[name]
        assert not torch.isnan(got).any(), f"{key}: {name} not fully covered by the ranks' slices"
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert err < rtol, f"{key}: parameter {name} differs by {err:.2e} (relative to its max)"


@pytest.mark.parametrize("key", ["dp2_ep1", "dp2_ep2"])
def test_two_rank_training_matches_single_process(reference, two_ranks, key):
    _check_matches(reference, two_ranks, key)


@pytest.mark.parametrize("key", ["dp4_ep1", "dp4_ep2", "dp4_ep4"])
def test_four_rank_training_matches_single_process(reference, four_ranks, key):
    _check_matches(reference, four_ranks, key)


def test_fsdp2_baseline_matches_single_process(reference, two_ranks):
    _check_matches(reference, two_ranks, "fsdp_dp2", rtol=1e-4)


@pytest.mark.parametrize("key", ["dp2_ep1", "dp2_ep2"])
def test_no_gradient_communication_on_non_final_micro_batches(two_ranks, key):
    for res in two_ranks:
        counts = res[key]["counts"]
        for name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor", "broadcast"):
            assert counts.get(("accum", name), 0) == 0, f"{key}: {name} during a non-final backward: {counts}"
        # Exactly one reduce-scatter per bucket per step, all on the final micro-batch (dense over dp=2;
        # experts over expert-dp: 2 with ep=1, none at all with ep=2 where expert-dp has one rank).
        buckets = res[key]["reduced_buckets"]
        assert buckets == (2 if key == "dp2_ep1" else 1)
        assert counts.get(("final", "reduce_scatter_tensor"), 0) == buckets * h.STEPS, counts
        if key.endswith("ep2"):  # token rows do travel in backward: that is activation, not gradient, traffic
            assert counts.get(("accum", "all_to_all_single"), 0) > 0, counts


def test_optimizer_state_per_rank_scales_as_one_over_dp(two_ranks, four_ranks):
    per_param = []
    for results, keys, dp in ((two_ranks, ("dp2_ep1", "dp2_ep2"), 2), (four_ranks, ("dp4_ep1", "dp4_ep2", "dp4_ep4"), 4)):
        for key in keys:
            for res in results:
                n, state = res[key]["num_params"], res[key]["state_bytes"]
                per_param.append(state * dp / n)  # fp32 master + 2 moments = 12 B per parameter
    # Bytes per rank x dp stays at 12 B/param (plus bucket padding) from dp=2 to dp=4, with or without EP.
    assert len(per_param) == 2 * 2 + 3 * 4
    assert all(12.0 <= b < 12.0 * 1.1 for b in per_param), per_param


def test_invalid_layouts_fail_fast_with_the_same_message_on_every_rank(four_ranks):
    messages = [res["invalid"] for res in four_ranks]
    assert all(m == messages[0] for m in messages), messages
    dp_pp, ep_dp, ep_experts = messages[0]
    assert "parallel.dp=2 x parallel.pp=1 = 2 does not equal world_size=4" in dp_pp
    assert "parallel.ep=3 does not divide parallel.dp=4" in ep_dp
    assert "model.num_experts=6 is not divisible by parallel.ep=4" in ep_experts
