"""Checkpoints cross parallel layouts: save at layout A, resume at layout B, and match an unbroken run at B.

Real trainers, real gloo process groups, real files. A -> B for 1 -> DP2, DP2 -> 1, DP2 -> DP2xEP2
and DP2xEP2 -> DP4; fp32, global batch fixed at 8 sequences, 3 steps at A then 3 at B; losses of
steps 4..6 within 1e-5 relative. Same-layout resume is bit-identical (test_trainer.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import layout_resume_worker as w  # noqa: E402

from moe_train.config import Config, ModelConfig, RouterConfig  # noqa: E402

pytestmark = pytest.mark.slow
RTOL = 1e-5


def layout_config(root: Path, data: Path, name: str, dp: int, ep: int, steps: int) -> Config:
    model = ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                        dense_hidden=64, dense_layers=[0], num_experts=4, expert_hidden=16, shared_expert_hidden=16,
                        router=RouterConfig(top_k=2, expert_bias=True, lb_loss_scope="global"))
    return w.run_config(model, data, root / name, steps, dp, ep)




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    root = tmp_path_factory.mktemp("layouts")
    data = prepare_data(list(stdlib_documents(150_000)), root / "data", vocab_size=512, source="stdlib-test")
    torch.set_num_threads(1)
    c = lambda name, dp, ep, steps=6: layout_config(root, data, name, dp, ep, steps)  # noqa: E731
    # One process: the unbroken reference at layout 1 (saves at step 3 too).
    w.run_trainer(c("one", 1, 1))
    # Two ranks: unbroken DP2 and DP2xEP2, then 1 -> DP2 and DP2 -> DP2xEP2 resumes.
    w.spawn(2, [
        (c("dp2", 2, 1), None),
        (c("dp2ep2", 2, 2), None),
        (c("one_to_dp2", 2, 1), (root / "one", root / "one_to_dp2")),
        (c("dp2_to_dp2ep2", 2, 2), (root / "dp2", root / "dp2_to_dp2ep2")),
    ], root / "spawn2")
    # One process again: DP2 -> 1.
    w.seed_run_dir(root / "dp2", root / "dp2_to_one")
    w.run_trainer(c("dp2_to_one", 1, 1))
    # Four ranks: unbroken DP4, then DP2xEP2 -> DP4.
    w.spawn(4, [
        (c("dp4", 4, 1), None),
        (c("dp2ep2_to_dp4", 4, 1), (root / "dp2ep2", root / "dp2ep2_to_dp4")),
    ], root / "spawn4")
    return root


@pytest.mark.parametrize("resumed,unbroken", [
    ("one_to_dp2", "dp2"), ("dp2_to_one", "one"), ("dp2_to_dp2ep2", "dp2ep2"), ("dp2ep2_to_dp4", "dp4"),
])
def test_resume_on_another_layout_matches_an_unbroken_run(runs, resumed, unbroken):
    got, want = w.losses(runs / resumed), w.losses(runs / unbroken)
    assert sorted(got) == [4, 5, 6], got  # the resumed run starts after the checkpoint's step
    for step in (4, 5, 6):
        assert abs(got[step] - want[step]) <= RTOL * abs(want[step]), (step, got[step], want[step])


def test_unbroken_layouts_agree_with_each_other(runs):
    ref = w.losses(runs / "one")
    for name in ("dp2", "dp2ep2", "dp4"):
        other = w.losses(runs / name)
        assert all(abs(other[s] - ref[s]) <= RTOL * abs(ref[s]) for s in range(1, 7)), (name, other, ref)
