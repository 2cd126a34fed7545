"""A run folder whose checkpoints/ holds a folder named as a later step that is no complete checkpoint (no
index.json: a copy in progress, a save killed by hand after its rename, damage) makes inspect, export-hf and
train.init_from read the newest complete step instead. They used to do so without a word; they now warn, naming the
folder and the step read (the Trainer's resume refuses such a run: test_checkpoint_resume's check_no_checkpoints_after)."""

from __future__ import annotations

import warnings

import pytest

from moe_ckpt import step_dir
from moe_train.cli import main
from moe_train.trainer.checkpoint import checkpoint_root, newest_checkpoint
from moe_train.trainer.loop import Trainer


def test_a_later_step_without_index_json_is_named_by_inspect_and_newest_checkpoint(tmp_path, data_dir, make_config,
                                                                                   capsys):
    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1, warmup_steps=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    run_dir, root = tmp_path / "run", checkpoint_root(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean run: not a word
        assert newest_checkpoint(run_dir) == step_dir(root, 1)
    later = step_dir(root, 3)
    later.mkdir()
    (later / "metadata.json").write_text("{}")  # a copy in progress: anything but index.json
    with pytest.warns(UserWarning, match=r"step-00000003 is named as a later step but holds no index\.json .*"
                                         r"reading step-00000001, the newest complete checkpoint"):
        assert newest_checkpoint(run_dir) == step_dir(root, 1)
    capsys.readouterr()
    assert main(["inspect", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert "step: 1" in captured.out, captured.out
    assert "step-00000003" in captured.err and "no index.json" in captured.err, captured.err
    from moe_train.hf_bridge import export_hf

    with warnings.catch_warnings(record=True) as caught:  # export-hf: once, not once per lookup (it said it twice)
        warnings.simplefilter("always")
        export_hf(run_dir, tmp_path / "hf", dtype="fp32", tokenizer_json=data_dir / "tokenizer.json", custom_code=True)
    assert sum("named as a later step" in str(c.message) for c in caught) == 1, [str(c.message) for c in caught]
