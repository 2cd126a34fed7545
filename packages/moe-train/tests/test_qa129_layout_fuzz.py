"""QA 129: a checkpoint resumes on parallel layouts test_layout_resume.py does not try, and what must be refused is.

The pairs that guard the most of qa129_sweep.py's table (run by hand): world 1 -> 3 with EP 1 -> 3 and the
distributed optimizer turned off; EP4 with bf16 resident weights and async saves -> one process in fp32 (and that
state loaded at either layout and saved again at once comes back bit for bit); a run with expert capacity resumed
on its own layout, pruning with keep_last; resumes of another network, refused in one line before any step. Every run evaluates every 4 steps and logs
every 2, so the step-3 resume point is a multiple of neither. Each resumed run is compared with an unbroken run at
the resumed layout.

Tolerances: fp32, 1e-5 relative (the sweep: 8e-8 or less; the reductions' order is all that differs). A run whose
steps 1-3 held bf16 weights and whose oracle held fp32 ones: 1e-4 relative (the sweep: 1.3e-5; each forward of
steps 1-3 rounds every weight to 8 bits of mantissa, 2^-9 relative, and AdamW's normalised updates carry that into
the masters; the loss moves by far less than a rounding step). The same layout: bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import qa129_worker as w  # noqa: E402

pytestmark = pytest.mark.slow
FP32_RTOL = 1e-5
BF16_TO_FP32_RTOL = 1e-4
EVAL = {"eval_interval": 4, "log_interval": 2, "eval_windows": 16}
KEEP = {"save_interval": 1, "keep_last": 2}

# resumes the checkpoint must refuse before any step: (model / data overrides, the field the one line names)
REFUSED = {
    "num_experts": ({"model": {"num_experts": 8}}, "model.num_experts"),
    "d_model": ({"model": {"d_model": 48}}, "model.d_model"),
    "seq_len": ({"data_fields": {"seq_len": 32}}, "data.seq_len"),
    "vocab_size": ({"model": {"vocab_size": 1024}}, "model.vocab_size"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    root = tmp_path_factory.mktemp("qa129")
    data = prepare_data(list(stdlib_documents(150_000)), root / "data", vocab_size=512, source="stdlib-test")
    threads = torch.get_num_threads()  # restored below: later tests in this worker keep theirs
    torch.set_num_threads(1)
    try:

        def c(key: str, name: str, **train):  # noqa: ANN202
            return w.layout_config(key, data, root / name, train={**EVAL, **train})

        w.run_trainer(c("1", "one"))
        w.spawn(4, [w.Job(c("dp4ep4-bf16-async", "ep4_bf16"))], root / "spawn4")
        bf16_ckpt = (root / "ep4_bf16", root / "ep4_bf16_resaved_dp3")
        w.spawn(3, [
            w.Job(c("dp3ep3-nodo", "dp3ep3_nodo")),
            w.Job(c("dp3ep3-nodo", "one_to_dp3ep3_nodo"), seed=(root / "one", root / "one_to_dp3ep3_nodo")),
            w.Job(c("dp3ep3-cap", "cap")),
            w.Job(c("dp3ep3-cap", "cap_to_cap", **KEEP), seed=(root / "cap", root / "cap_to_cap")),
            w.Job(c("dp3ep3-nodo", bf16_ckpt[1].name), seed=bf16_ckpt, resave_to=root / "resaved_dp3"),
        ], root / "spawn3")
        w.seed_run_dir(root / "ep4_bf16", root / "ep4_bf16_to_one")
        w.run_trainer(c("1", "ep4_bf16_to_one"))
        w.seed_run_dir(root / "ep4_bf16", root / "ep4_bf16_resaved_one")
        w.run_job(w.Job(c("1", "ep4_bf16_resaved_one"), resave_to=root / "resaved_one"))
        return root, data
    finally:
        torch.set_num_threads(threads)


def _close(got: dict[int, float], want: dict[int, float], rtol: float) -> None:
    assert sorted(got) == [s for s in sorted(want) if s > w.RESUME_STEP], (got, want)
    for step in got:
        assert abs(got[step] - want[step]) <= rtol * abs(want[step]), (step, got[step], want[step])


def test_one_process_resumes_on_three_ranks_with_ep3_and_a_replicated_optimizer(runs):
    root, _ = runs
    got, want = root / "one_to_dp3ep3_nodo", root / "dp3ep3_nodo"
    _close(w.losses(got), w.losses(want), FP32_RTOL)
    _close(w.eval_losses(got), w.eval_losses(want), FP32_RTOL)
    # the routers' expert bias moves by +-rate per step from the load: it carried over and moved alike
    assert w.max_state_diff(w.final_state(got), w.final_state(want), "expert_bias") == 0


def test_ep4_bf16_async_checkpoint_resumes_on_one_fp32_process(runs):
    root, _ = runs
    _close(w.losses(root / "ep4_bf16_to_one"), w.losses(root / "one"), BF16_TO_FP32_RTOL)
    _close(w.eval_losses(root / "ep4_bf16_to_one"), w.eval_losses(root / "one"), BF16_TO_FP32_RTOL)


def test_capacity_run_resumed_on_its_layout_is_bit_identical_and_prunes(runs):
    root, _ = runs
    got, want = root / "cap_to_cap", root / "cap"
    _close(w.losses(got), w.losses(want), 0.0)
    _close(w.eval_losses(got), w.eval_losses(want), 0.0)
    assert w.max_state_diff(w.final_state(got), w.final_state(want)) == 0
    assert w.checkpoint_steps(got) == [5, 6]  # keep_last=2 pruned the step-3 checkpoint the run resumed from


@pytest.mark.parametrize("layout", ["one", "dp3"])
def test_bf16_ep4_state_loaded_at_another_layout_saves_back_bit_for_bit(runs, layout):
    """Loaded at one fp32 process or at DP3xEP3 without ZeRO and saved again at once, the EP4 bf16 run's step-3
    checkpoint comes back unchanged: masters, moments, step counts, expert bias, sampler, RNG; each weight its fp32
    master (not the bf16 copy the EP4 run held)."""
    root, _ = runs
    saved = root / "ep4_bf16" / "checkpoints" / "step-00000003"
    assert w.round_trip_differences(saved, root / f"resaved_{layout}" / "checkpoints" / "step-00000003", False) == []


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_resume_of_another_network_is_refused_in_one_line_leaving_the_folder(runs, name):
    root, data = runs
    over, field = REFUSED[name]
    dst = root / f"refused_{name}"
    w.seed_run_dir(root / "one", dst)
    before = w.snapshot(dst)
    cfg = w.layout_config("1", data, dst, model=over.get("model"), data_fields=over.get("data_fields"))
    message = w.run_job(w.Job(cfg, refused=True))
    assert message != "no error" and "\n" not in message and field in message, message
    assert w.snapshot(dst) == before
