"""The runtime as the pretraining stack uses it, at world sizes 3 and 6, against torch.optim.AdamW on one process.

One spawn of 3 gloo ranks and one of 6 (runtime_qa_worker.py runs every check inside them):
- dp=3 ep=1 / ep=3 and dp=6 ep=2 / ep=3, fp32 and bf16 weights with fp32 masters, sharded and all-reduce,
  small and large buckets: parameters of 1 and 0 elements, odd shapes, 40 small ones and one of 20k
  (shards cut through them), expert parameters [E, ...] sliced over ep; 3 (fp32) or 2 (bf16)
  micro-batches; clipping that binds, an lr that changes every step, betas / eps / weight decay off
  their defaults; a parameter no rank uses on odd steps, one used on one rank only, an expert slice
  without gradient on a whole EP block; a NaN on the last rank at one step. Grad norms and fp32
  masters within 1e-5 of torch; step counts equal torch's; every rank's weights equal the masters cast
  to the weight dtype; no collective on non-final micro-batches; a skipped step on every rank.
- A real MoE layer (moe_kernels dispatch, SwiGLU experts) with routing given by the data: an expert
  that gets no token from one rank, an EP rank that receives no rows in a micro-batch and in a whole step.
- Optimizer state carried by global name and offset from dp=6 ep=3 to dp=4 ep=2 (uneven shards) continues
  as the unbroken single-process run.
- Misuse fails on every rank with a message naming the value: step() without or twice per finish(),
  one parameter or name twice, settings that would make NaN weights, ranks holding other parameters;
  replicas seeded differently start from the first rank's weights; a second gradient in the last
  micro-batch is reduced with its bucket, or refused once the bucket has left.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import parallel_spawn  # noqa: E402
import runtime_qa_worker as w  # noqa: E402

pytestmark = pytest.mark.slow
RTOL = 1e-5
DEADLINE_S = {3: 150, 6: 240}  # observed ~20 s and ~45 s on 2 CPU cores


def spawn(world: int, out_dir: Path) -> list[dict]:
    return parallel_spawn.run_ranks(w.run_rank, world, out_dir, DEADLINE_S[world])


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return spawn(3, tmp_path_factory.mktemp("qa3"))


@pytest.fixture(scope="module")
def world6(tmp_path_factory):
    return spawn(6, tmp_path_factory.mktemp("qa6"))


@pytest.fixture(scope="module")
def ranks(world3, world6):
    return {3: world3, 6: world6}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12)).item()


def assemble_state(results: list[dict], want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's uniquely owned master pieces -> global fp32 tensors; an element owned twice or never fails."""
    full = {n: torch.full((t.numel(),), float("nan")) for n, t in want.items()}
    for res in results:
        for name, offset, master, _, _ in res["state"]:
            piece = full[name][offset : offset + master.numel()]
            assert torch.isnan(piece).all(), f"{name}[{offset}:] owned by two ranks"
            piece.copy_(master)
    for name, t in full.items():
        assert not torch.isnan(t).any(), f"{name}: elements {torch.isnan(t).nonzero().flatten().tolist()[:5]} owned by no rank"
    return {n: t.view(want[n].shape) for n, t in full.items()}


def check_against_reference(results: list[dict], ref: dict, dtype: torch.dtype, steps: range) -> None:
    masters = assemble_state(results, ref["weights"])
    for name, want in ref["weights"].items():
        assert relative_error(masters[name], want) < RTOL, f"master of {name}: {relative_error(masters[name], want):.2e}"
    clean = [s for s in steps if s != w.NAN_STEP]
    for r, res in enumerate(results):
        assert res["skipped"] == [s == w.NAN_STEP for s in steps], f"rank {r}: skipped {res['skipped']}"
        assert not any(res["reductions_early"]), f"rank {r}: collectives on non-final micro-batches"
        got = torch.tensor(res["norms"], dtype=torch.float64)[[s - steps.start for s in clean]]
        want = torch.tensor(ref["norms"], dtype=torch.float64)[clean]
        assert ((got - want).abs() / want).max() < RTOL, f"rank {r}: grad norms {got.tolist()} vs {want.tolist()}"
        assert res["counts"] == ref["counts"], f"rank {r}: step counts differ from torch AdamW"
        for name, (row, weight) in res["weights"].items():  # the bf16 copies are the masters, refreshed
            want_w = masters[name][row : row + weight.shape[0]] if weight.dim() else masters[name]
            assert weight.dtype == dtype and torch.equal(weight, want_w.to(dtype)), f"rank {r}: {name} is not its master"


@pytest.mark.parametrize("world,key,dp,ep,dtype", [(world, key, dp, ep, dtype) for world, runs in w.SYNTHETIC.items()
                                                    for key, dp, ep, dtype, _, _ in runs])
def test_uneven_shards_and_odd_parameters_match_single_process_adamw(ranks, world, key, dp, ep, dtype):
    ref = w.synthetic_reference([(dp, ep)] * w.STEPS, dtype)
    assert max(ref["norms"]) > w.CFG.grad_clip and math.isnan(ref["norms"][w.NAN_STEP])  # clipping binds; a NaN step
    assert 0 < ref["counts"]["gate"] < w.STEPS - 1 and ref["counts"]["tiny"] == w.STEPS - 1
    results = [res[key] for res in ranks[world]]
    check_against_reference(results, ref, dtype, range(w.STEPS))
    for res in results:
        assert res["skipped_steps"] == 1 and res["step_count"] == w.STEPS - 1


@pytest.mark.parametrize("world", sorted(w.ROUTED))
def test_routed_moe_with_experts_that_get_no_tokens_matches_single_process(ranks, world):
    key, dp, ep = w.ROUTED[world]
    ref = w.routed_reference(dp, ep)
    assert max(ref["norms"]) > w.ROUTED_CFG.grad_clip
    initial = dict(w.RoutedNet().named_parameters())
    for r, res in enumerate(ranks[world]):
        got = torch.tensor(res[key]["norms"], dtype=torch.float64)
        want = torch.tensor(ref["norms"], dtype=torch.float64)
        assert ((got - want).abs() / want).max() < RTOL, f"rank {r}: grad norms {got.tolist()} vs {want.tolist()}"
        for name, (row, weight) in res[key]["weights"].items():
            want_w = ref["weights"][name][row : row + weight.shape[0]]
            assert not torch.equal(want_w, initial[name][row : row + weight.shape[0]])
            assert relative_error(weight, want_w) < RTOL, f"rank {r}: {name} off by {relative_error(weight, want_w):.2e}"


def test_optimizer_state_moved_to_another_uneven_layout_continues_the_unbroken_run(ranks):
    steps_a, dp_a, ep_a, dp_b, ep_b = w.RELAYOUT
    ref = w.synthetic_reference([(dp_a, ep_a)] * steps_a + [(dp_b, ep_b)] * (w.STEPS - steps_a), torch.bfloat16)
    results = [res["relayout"] for res in ranks[6][:dp_b]]
    assert all(res["relayout"] == {} for res in ranks[6][dp_b:])
    check_against_reference(results, ref, torch.bfloat16, range(steps_a, w.STEPS))


def test_step_needs_one_finish_each_time(ranks):
    for r, res in enumerate(ranks[3]):
        out = res["misuse_step_order"]
        for key in ("step_before_backward", "second_step_same_gradients", "step_after_zero_grads"):
            assert out[key].startswith("RuntimeError: DistributedAdamW.step(): the gradients of flats[0] were not "
                                       "reduced for this step; expected GradientSync.finish()"), f"rank {r} {key}: {out[key]}"
        assert out["first_step"] == out["next_step"] == "accepted", f"rank {r}: {out}"
        assert out["counts"] == {"p0": 2, "p1": 2}, f"rank {r}: {out['counts']}"


def test_a_parameter_or_name_registered_twice_is_refused_naming_it(ranks):
    for r, res in enumerate(ranks[3]):
        out = res["misuse_registration"]
        assert out["param_twice"] == ("ValueError: FlatParams got one parameter twice, as 'p0' and 'again': expected "
                                      "each parameter once (model.named_parameters() lists a shared one once)"), out
        assert out["param_twice_fp32_accumulation"].startswith("ValueError: FlatParams got one parameter twice, as 'a' and 'b'"), out
        assert out["name_twice"] == "ValueError: FlatParams got the name 'p0' twice: expected one entry per parameter name", out
        for who in ("sync", "optimizer"):
            owner = "GradientSync" if who == "sync" else "DistributedAdamW"
            assert out[f"param_in_two_flats_{who}"] == (
                f"ValueError: {owner}: the parameter 'p0' of flats[1] is also 'p0' of flats[0]; expected each "
                "parameter in one FlatParams (dense over dp, experts over expert-dp)"), out
        assert out["no_flats_optimizer"] == "ValueError: DistributedAdamW needs at least one FlatParams, got none", out
        for value in ("0", "-3", "True", "2.0"):
            assert out[f"divisor_{value}"] == (f"ValueError: GradientSync: divisor={value} must be a positive integer "
                                               "(the dense dp size)"), out


def test_settings_that_would_make_nan_weights_are_refused_naming_them(ranks):
    for res in ranks[3]:
        out = res["misuse_config"]
        assert out["lr_negative"] == "ValueError: AdamWConfig: lr=-0.001 must be a finite number >= 0", out
        assert out["lr_nan"] == "ValueError: AdamWConfig: lr=nan must be a finite number >= 0", out
        assert out["beta1_one"] == "ValueError: AdamWConfig: betas=(1.0, 0.95) must be two numbers in [0, 1)", out
        assert out["beta2_negative"].startswith("ValueError: AdamWConfig: betas=(0.9, -0.1)"), out
        assert out["betas_three"].startswith("ValueError: AdamWConfig: betas=(0.9, 0.95, 0.99)"), out
        assert out["eps_zero"] == "ValueError: AdamWConfig: eps=0.0 must be a finite number > 0", out
        assert out["weight_decay_negative"] == "ValueError: AdamWConfig: weight_decay=-0.1 must be a finite number >= 0", out
        assert out["grad_clip_negative"] == ("ValueError: AdamWConfig: grad_clip=-1.0 must be a finite number >= 0 "
                                             "(0 disables clipping)"), out
        assert out["grad_clip_inf"].startswith("ValueError: AdamWConfig: grad_clip=inf"), out
        assert out["step_lr_nan"] == "ValueError: DistributedAdamW.step: lr=nan must be a finite number >= 0", out
        assert out["step_lr_negative"] == "ValueError: DistributedAdamW.step: lr=-0.5 must be a finite number >= 0", out
        assert out["step_lr_nan_weights_finite"] and out["step_lr_negative_weights_finite"], out
        assert out["step_count_negative"] == "ValueError: step_count=-1: expected an integer >= 0", out


def test_ranks_holding_other_parameters_fail_together_naming_the_first_difference(ranks):
    end = ("; expected every rank of the group to build the same model (same parameter names, shapes and dtype, "
           "in the same order)")
    for r, res in enumerate(ranks[3]):  # rank 2 holds the other model; every rank must raise the same error
        out = res["misuse_ranks_differ"]
        assert out["shape_transposed"] == ("ValueError: FlatParams: the parameters differ across ranks: rank 0 has "
                                           "'p0' (4, 3) torch.float32 where rank 2 has 'p0' (3, 4) torch.float32 "
                                           "(3 vs 3 entries)" + end), f"rank {r}: {out['shape_transposed']}"
        assert out["extra_parameter"].startswith("ValueError: FlatParams: the parameters differ across ranks: rank 0 "
                                                 "has (nothing more) where rank 2 has 'p2' (2,) torch.float32 (3 vs 4 "
                                                 "entries)"), f"rank {r}: {out['extra_parameter']}"
        assert out["other_dtype"].startswith("ValueError: FlatParams: the parameters differ across ranks: rank 0 has "
                                             "FlatParams(shard=True, grad_dtype=torch.float32"), out["other_dtype"]
        assert out["extra_expert_parameter"].startswith(
            "ValueError: DistributedAdamW: the config and the parameters (expert parameters as this rank's slice) differ "
            "across ranks: "
            "rank 0 has (nothing more) where rank 2 has flats[1] 'experts.w2' (2, 2) torch.float32"), out["extra_expert_parameter"]


@pytest.mark.parametrize("shard", [True, False])
def test_replicas_seeded_differently_start_from_the_first_ranks_weights(ranks, shard):
    for r, res in enumerate(ranks[3]):
        out = res["misuse_ranks_differ"]
        assert out[f"replicas_identical_shard={shard}"] and out[f"rank0_values_shard={shard}"], f"rank {r}: {out}"


@pytest.mark.parametrize("shard", [True, False])
def test_second_backward_in_the_last_micro_batch_is_reduced_with_its_bucket(ranks, shard):
    for r, res in enumerate(ranks[3]):
        out = res["misuse_two_backwards_in_last_micro_batch"]
        # b's gradient must be in the buffer when its bucket is reduced: a's second arrival may not launch it
        assert out[f"legit_shard={shard}_launched_before_b"] == [False], f"rank {r}: {out}"
        assert out[f"legit_shard={shard}_grad_ok"], f"rank {r}: {out}"


@pytest.mark.parametrize("shard", [True, False])
def test_gradient_arriving_after_its_bucket_was_reduced_is_an_error(ranks, shard):
    for r, res in enumerate(ranks[3]):
        got = res["misuse_two_backwards_in_last_micro_batch"][f"late_shard={shard}"]
        assert got.startswith("RuntimeError: GradientSync: 'a' received another gradient after its bucket's reduction "
                              "was launched, so that gradient would be left out of the reduction"), f"rank {r}: {got}"


def test_model_zero_grad_before_each_step_still_trains(ranks):
    for r, res in enumerate(ranks[3]):
        out = res["misuse_torch_habits"]
        plain, habit = out["zero_grad=False"], out["zero_grad=True"]
        assert min(plain["norms"]) > 0 and habit["norms"] == plain["norms"], f"rank {r}: {habit['norms']} vs {plain['norms']}"
        assert all(torch.equal(a, b) for a, b in zip(habit["weights"], plain["weights"])), f"rank {r}"


def test_parameter_rebound_after_flat_params_is_an_error_naming_it(ranks):
    for r, res in enumerate(ranks[3]):
        got = res["misuse_torch_habits"]["rebound"]
        assert got.startswith("RuntimeError: 'p1' no longer lives in the FlatParams buffer that the optimizer updates"), got
