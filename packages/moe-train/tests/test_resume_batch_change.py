"""A resume that changes the global batch (micro-batch x grad_accum x dp) says so once, naming both sizes; one that
keeps it says nothing about the batch. The batch ramp is allowed: the run goes on, its lr schedule by step."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402

from moe_train.trainer.loop import Trainer  # noqa: E402


def _resume_warnings(tmp_path, data_dir, **changed) -> list[str]:
    first = small_config(tmp_path, steps=2, save_interval=2, eval_interval=0, micro_batch_size=4, grad_accum=2)
    first.data.path = str(data_dir)
    Trainer(first).train()
    again = small_config(tmp_path, steps=3, save_interval=0, eval_interval=0,
                         **{"micro_batch_size": 4, "grad_accum": 2, **changed})
    again.data.path = str(data_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(again).train()
    return [str(w.message) for w in caught if "global batch" in str(w.message)]


def test_a_resume_with_another_global_batch_warns_naming_both_sizes(tmp_path, data_dir):
    got = _resume_warnings(tmp_path, data_dir, micro_batch_size=2, grad_accum=3)
    assert len(got) == 1, got
    assert got[0].startswith("the global batch changes at step 2: 6 sequences per step now (train.micro_batch_size=2 "
                             "x train.grad_accum=3 x parallel.dp=1), 8 in the run that wrote the checkpoint"), got[0]


def test_a_resume_with_the_same_global_batch_split_another_way_says_nothing_about_it(tmp_path, data_dir):
    assert _resume_warnings(tmp_path, data_dir, micro_batch_size=8, grad_accum=1) == []
