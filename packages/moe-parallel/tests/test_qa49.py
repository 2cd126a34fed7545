"""Independent QA (2 gloo ranks, one spawn, ~15 s on 2 cores): another micro-batch begun after the last one's
backward (its reductions may be in flight) or after finish() (the reduced gradients await the step) is refused
on every rank instead of dropping or double-counting gradients; fp64 weights keep fp64 masters and match
torch.optim.AdamW in fp64 over 20 steps (they were rounded to fp32 every step); FlatParams given
model.parameters() names the mistake."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("qa49_worker")
parallel_spawn = importlib.import_module("parallel_spawn")

WORLD = 2
DEADLINE_S = 120


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return parallel_spawn.run_ranks(worker.run_rank, WORLD, tmp_path_factory.mktemp("qa49"), DEADLINE_S)


@pytest.mark.parametrize("shard", [True, False])
@pytest.mark.parametrize("second_final", [True, False])
def test_a_micro_batch_begun_after_the_last_ones_backward_is_refused_and_the_last_one_reduced_once(
        ranks, shard, second_final):
    for r, res in enumerate(ranks):
        got = res[f"again_shard={shard}_final={second_final}"]
        assert isinstance(got, dict), f"rank {r}: {got}"
        assert got["again"].startswith(
            f"RuntimeError: GradientSync.begin_backward(final={second_final}) after begin_backward(final=True) "
            "without finish()"), f"rank {r}: {got['again']}"
        # the first micro-batch only: (1 + 2) / 2 for each of the 8 elements (sharded: this rank's 4 of them)
        want = [1.5] * (4 if shard else 8)
        assert got["grad"] == want, f"rank {r}: {got['grad']}"


@pytest.mark.parametrize("shard", [True, False])
def test_a_micro_batch_begun_between_finish_and_the_step_is_refused(ranks, shard):
    for r, res in enumerate(ranks):
        got = res[f"before_step_shard={shard}"]
        assert isinstance(got, dict), f"rank {r}: {got}"
        assert got["next_micro_batch"].startswith(
            "RuntimeError: GradientSync.begin_backward(final=False): the gradients of flats[0] were reduced by "
            "finish() and not yet used"), f"rank {r}: {got['next_micro_batch']}"
        assert got["after_step"] == "accepted", f"rank {r}: {got['after_step']}"
    # the reduced gradient, untouched: (1 + 2) / 2 for the 4 elements (sharded: rank 0 owns all 4, rank 1 padding)
    grads = [res[f"before_step_shard={shard}"]["grad"] for res in ranks]
    assert grads == ([[1.5] * 4, []] if shard else [[1.5] * 4] * 2), grads


@pytest.mark.parametrize("shard", [True, False])
def test_zero_grads_abandons_a_step_begun_as_final_and_the_next_step_reduces_only_its_own(ranks, shard):
    for r, res in enumerate(ranks):
        got = res[f"abandon_shard={shard}"]
        assert isinstance(got, dict), f"rank {r}: {got}"
        assert got["next"] == "accepted", f"rank {r}: {got['next']}"
        assert got["grad"] == [1.5] * (4 if shard else 8), f"rank {r}: {got['grad']}"  # (1 + 2) / 2, not 100


@pytest.mark.parametrize("shard", [True, False])
def test_the_next_step_without_sync_zero_grads_is_refused(ranks, shard):
    for r, res in enumerate(ranks):
        got = res[f"no_zero_grads_shard={shard}"]
        assert isinstance(got, dict), f"rank {r}: {got}"
        assert got["next_step"].startswith(
            "RuntimeError: GradientSync.begin_backward(final=True): the gradients of flats[0] were used by the last "
            "optimizer step and not cleared; expected sync.zero_grads()"), f"rank {r}: {got['next_step']}"
        assert got["after_zero_grads"] == "accepted", f"rank {r}: {got['after_zero_grads']}"


@pytest.mark.parametrize("shard", [True, False])
def test_fp64_weights_keep_fp64_masters_and_match_torch_adamw_in_fp64(ranks, shard):
    ref = worker.fp64_reference(WORLD)
    for r, res in enumerate(ranks):
        got = res[f"fp64_shard={shard}"]
        assert isinstance(got, dict), f"rank {r}: {got}"
        for name, want in ref["weights"].items():
            w = got["weights"][name]
            err = float((w - want).abs().max() / want.abs().max())
            assert err < 1e-12, f"rank {r} {name}: relative error {err:.3g} (fp32 masters give ~1e-7)"
        for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
            assert abs(a - b) <= 1e-12 * b, f"rank {r} step {step}: grad norm {a!r} vs {b!r}"
        assert got["state_bytes_per_element"] == 24, f"rank {r}: {got['state_bytes_per_element']}"


@pytest.mark.parametrize("key, kind", [("linear_5x3", "Parameter"), ("linear_2x3", "Parameter"),
                                       ("unnamed_pair", "tuple")])
def test_flat_params_given_unnamed_parameters_is_refused_naming_the_entry(ranks, key, kind):
    for r, res in enumerate(ranks):
        got = res["unnamed"][key]
        assert got == (f"ValueError: FlatParams: named_params[0] is a {kind}, expected a (name, parameter) pair "
                       "(pass model.named_parameters(), not model.parameters())"), f"rank {r}: {got}"


def test_ranks_ran_the_source_under_test(ranks):
    import moe_parallel

    for r, res in enumerate(ranks):
        assert res["moe_parallel_file"] == moe_parallel.__file__, f"rank {r}: {res['moe_parallel_file']}"


def test_ranks_with_different_optimizer_configs_are_refused_on_every_rank(ranks):
    for r, res in enumerate(ranks):
        got = res["config_differs"]
        assert got.startswith("ValueError: DistributedAdamW: the config and the parameters (expert parameters as this "
                              "rank's slice) differ across ranks: rank 0 has config AdamWConfig("), f"rank {r}: {got}"
        assert "grad_clip=1.0" in got and "grad_clip=2.0" in got, f"rank {r}: {got}"
