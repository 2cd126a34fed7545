"""Each parameter's AdamW step count survives a checkpoint, on the same and on another parallel layout.

A parameter no rank gave a gradient on a step keeps its step count (as torch.optim.AdamW skips grad=None),
so counts differ between parameters and bias correction depends on each one's own count. The model (see
step_counts_worker.py) has a branch run on even steps (`gate`), one from step 4 on (`late`, first used
after the checkpoint at step 3) and one never run. Runs: one process (LocalRuntime) and two gloo ranks
(DistributedRuntime, ZeRO-1), 6 steps unbroken or 3 + 3 across a checkpoint written by the real save path.
One process and DP2 differ by fp32 round-off only; a same-layout resume is bit-identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import step_counts_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402

from moe_ckpt import inspect_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
RTOL = 1e-5  # one process against DP2: the same sums in another order


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("step_counts")
    torch.set_num_threads(1)
    out = {"one": w.train(root / "one", 1)}
    w.train(root / "one_first_half", 1, steps=w.SAVE_AT)  # stops at the checkpoint, as an interrupted run
    out["one_resumed"] = w.train(root / "one_resumed", 1, resume_from=w.saved_at(root / "one_first_half"))
    old = w.with_one_step_count(w.saved_at(root / "one"), root / "one_step_count")
    out["one_step_count_tensors"] = set(inspect_checkpoint(old)["tensors"])
    out["one_step_count"] = w.train(root / "one_step_count_resumed", 1, resume_from=old)
    ports = [h.free_port() for _ in range(4)]
    h.start_ranks(h.run_guarded, args=(w.worker, str(root), ports, str(root)), nprocs=2)
    ranks = h.load_results(root, 2)
    for name, res in ranks[0].items():
        for other in ranks[1:]:  # replicas leave every step with identical weights
            assert all(torch.equal(res["weights"][n], other[name]["weights"][n]) for n in res["weights"]), name
        out[name] = res
    out["dp2_to_one"] = w.train(root / "dp2_to_one", 1, resume_from=w.saved_at(root / "dp2"))
    return out


def max_relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert set(got) == set(want)
    return {n: ((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want}


def test_the_unbroken_runs_count_steps_per_parameter(runs):
    for name in ("one", "dp2"):
        assert runs[name]["counts"] == w.COUNTS_AT_END, name
    assert (runs["one"]["runtime"], runs["dp2"]["runtime"]) == ("LocalRuntime", "DistributedRuntime")


@pytest.mark.parametrize("resumed,unbroken", [("one_resumed", "one"), ("dp2_resumed", "dp2")])
def test_resume_with_parameters_skipped_before_the_checkpoint_is_bit_identical(runs, resumed, unbroken):
    assert runs[resumed]["counts_at_resume"] == w.COUNTS_AT_SAVE
    assert runs[resumed]["counts"] == w.COUNTS_AT_END
    for n, want in runs[unbroken]["weights"].items():
        assert torch.equal(runs[resumed]["weights"][n], want), n


@pytest.mark.parametrize("resumed,unbroken", [("one_to_dp2", "dp2"), ("dp2_to_one", "one")])
def test_resume_on_another_layout_keeps_each_parameters_step_count(runs, resumed, unbroken):
    assert runs[resumed]["counts_at_resume"] == w.COUNTS_AT_SAVE
    assert runs[resumed]["counts"] == w.COUNTS_AT_END
    errors = max_relative_error(runs[resumed]["weights"], runs[unbroken]["weights"])
    assert max(errors.values()) < RTOL, errors
    assert torch.equal(runs[resumed]["weights"]["never"], runs[unbroken]["weights"]["never"])


@pytest.mark.parametrize("resumed", ["one_step_count", "one_step_count_to_dp2"])
def test_a_checkpoint_with_one_step_count_resumes_every_parameter_from_it(runs, resumed):
    """moe-train 0.5.0 stored only optim.step: every parameter resumes from it (the old behaviour), on any layout."""
    tensors = runs["one_step_count_tensors"]
    assert "optim.step" in tensors and not [n for n in tensors if n.endswith(".step") and n != "optim.step"]
    assert runs[resumed]["counts_at_resume"] == dict.fromkeys(w.COUNTS_AT_SAVE, w.SAVE_AT)
    # so gate and late resume with a count too high and end away from the unbroken run
    assert runs[resumed]["counts"] == {n: c + w.SAVE_AT - w.COUNTS_AT_SAVE[n] for n, c in w.COUNTS_AT_END.items()}
    errors = max_relative_error(runs[resumed]["weights"], runs["one"]["weights"])
    assert errors["late"] > 1e-3, errors
