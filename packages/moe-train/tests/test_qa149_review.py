"""QA 149: review helpers 159 (the multi-rank runtime) and 160 (moe-train as a new user), moe-train 0.27.22.

Found (each fixed in moe-train 0.27.23; the tests here fail on 0.27.22):
1. A step that takes more windows than the train split holds (train.micro_batch_size x grad_accum x dp) trained
   silently, each step holding some windows twice: now a start warning naming the three fields and the count.
Also fixed, with their tests beside the older ones: the step that ends a streak of non-finite steps is logged
(test_qa51), a changed train.seed on resume is named as ignored (test_resume_robustness), and a token file damaged
after prepare-data no longer advises raising model.vocab_size (test_data_token_id_checks)."""

from __future__ import annotations

import json
import warnings

import torch

from moe_train.trainer.loop import Trainer
from moe_train.trainer.start_warnings import warn_about_settings


def _start_warnings(cfg) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(cfg).close()
    return [str(w.message) for w in caught]


def test_a_step_larger_than_the_train_split_warns_at_the_start(tmp_path, data_dir, make_config):
    meta = json.loads((data_dir / "meta.json").read_text())
    windows = (meta["splits"]["train"]["num_tokens"] - 1) // 32  # small_config's data.seq_len
    fits = make_config(tmp_path, micro_batch_size=windows // 2, grad_accum=2, eval_interval=0)
    assert not [m for m in _start_warnings(fits) if "a step takes" in m]
    over = make_config(tmp_path, micro_batch_size=windows // 2 + 1, grad_accum=2, eval_interval=0)
    got = [m for m in _start_warnings(over) if "a step takes" in m]
    assert got == [f"a step takes {2 * (windows // 2 + 1)} windows (train.micro_batch_size={windows // 2 + 1} x "
                   f"train.grad_accum=2 x parallel.dp=1) and the train split holds {windows} of data.seq_len=32: "
                   "every step trains on some windows more than once; prepare more data, shorten data.seq_len or "
                   "take fewer windows a step"], got


def test_the_warning_counts_every_data_parallel_rank(tmp_path, make_config):
    cfg = make_config(tmp_path, micro_batch_size=3, grad_accum=2)
    cfg.parallel.dp = 4  # 24 windows a step

    def said(train_windows: int) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_about_settings(cfg, torch.device("cpu"), train_windows=train_windows)
        return [str(w.message) for w in caught if "a step takes" in str(w.message)]

    assert said(24) == []
    assert len(said(23)) == 1 and said(23)[0].startswith("a step takes 24 windows"), said(23)
