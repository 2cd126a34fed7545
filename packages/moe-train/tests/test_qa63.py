"""QA 63: the newcomer's walk through the READMEs. What the CLI says after prepare-data, export-hf and a Ctrl-C:
the next command to run, which checkpoint was exported, and where running the stopped command again resumes."""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import SignalAtStep2, small_config  # noqa: E402

from moe_train.cli import main  # noqa: E402
from moe_train.trainer import loop  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402

SMALL = ["--model.num_layers=1", "--model.d_model=32", "--data.seq_len=32", "--train.micro_batch_size=2",
         "--train.eval_interval=0", "--train.device=cpu"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    return prepare_data(list(stdlib_documents(100_000)), tmp_path_factory.mktemp("qa63") / "data", vocab_size=512,
                        source="stdlib-test")


def test_prepare_data_prints_a_train_command_that_runs_on_the_folder(tmp_path, monkeypatch, capsys):
    """prepare-data said only `wrote data/mine`; the obvious next step, training the tiny preset on it with
    --data.path, was refused (token ids >= model.vocab_size=2048) because prepare-data's BPE is 4096 by default."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    for i in range(3):
        (tmp_path / "texts" / f"doc{i}.txt").write_text(
            "\n".join(f"line {j} of document {i}: the quick brown fox {j * i} jumps" for j in range(400)))
    assert main(["prepare-data", "texts", "--out", "my data", "--vocab-size", "600"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("wrote my data: ") and "train tokens" in out[0] and "vocab_size=" in out[0], out
    hint = [line for line in out if line.startswith("train on it: ")]
    assert hint, out
    argv = shlex.split(hint[0].removeprefix("train on it: "))
    assert argv[:2] == ["moe-train", "train"], argv
    assert main(argv[1:] + SMALL + ["--train.steps=1", "--train.progress=false", "--run-dir=run"]) == 0
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_export_hf_names_the_checkpoint_it_exported_not_a_dataclass_repr(tmp_path, data, capsys):
    cfg = small_config(tmp_path, steps=2, save_interval=1, eval_interval=0, grad_accum=1)
    cfg.data.path, cfg.train.device = str(data), "cpu"
    cfg.model.router.expert_bias, cfg.model.shared_expert_hidden = False, 0  # as Qwen3-MoE: exports
    Trainer(cfg).train()
    capsys.readouterr()
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "ExportSummary(" not in out and "PosixPath(" not in out, out
    assert "step-00000002" in out and "Qwen" in out and "MiB of bf16" in out, out
    assert "AutoModelForCausalLM.from_pretrained" in out, out


def _ctrl_c_at_step_2(tmp_path, data, monkeypatch, *extra):
    monkeypatch.setattr(loop, "make_runtime", lambda cfg, device: SignalAtStep2(cfg, device))
    argv = ["train", f"--data.path={data}", f"--train.run_dir={tmp_path / 'run'}", "--train.steps=4",
            "--model.vocab_size=512", *SMALL, *extra]
    return main(argv)


def test_a_ctrl_c_says_which_checkpoint_the_same_command_resumes_from(tmp_path, data, monkeypatch, capsys):
    """The line said `stopped ... after step 197 of 300` and nothing of the 97 steps since the step-100 checkpoint
    that running again trains over; a run that had saved nothing looked the same."""
    assert _ctrl_c_at_step_2(tmp_path, data, monkeypatch, "--train.save_interval=1",
                             "--train.progress=false") == 128 + signal.SIGINT
    out = capsys.readouterr().out
    assert "latest checkpoint: " in out and "step-00000001" in out and "resume from step 1" in out, out

    assert _ctrl_c_at_step_2(tmp_path / "b", data, monkeypatch, "--train.save_interval=0",
                             "--train.progress=false") == 128 + signal.SIGINT
    out = capsys.readouterr().out
    assert "no checkpoint" in out and "train.save_interval=0" in out and "step 0" in out, out


def test_a_ctrl_c_line_comes_after_the_progress_bar_is_closed(tmp_path, data, monkeypatch, capsys):
    """The progress bar was closed only when the exception's frames were freed, after the CLI's line: on a terminal
    the line was glued to the end of the bar and the bar redrawn below it."""
    assert _ctrl_c_at_step_2(tmp_path, data, monkeypatch, "--train.save_interval=0",
                             "--train.progress=true") == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "step/s" in err  # the bar was drawn
    assert err.endswith("moe-train: stopped by SIGINT (Ctrl-C), after step 1 of 4\n"), repr(err[-300:])
    assert "\nmoe-train: stopped by" in err, repr(err[-300:])  # on a line of its own


def test_a_token_id_past_the_model_vocabulary_says_what_to_set(tmp_path):
    """The first error a user meets after prepare-data with the tiny preset: it names the vocab_size to set
    (it said only what the data was tokenized with)."""
    import json

    import numpy as np
    import pytest

    from moe_train.data import DataError, open_data

    folder = tmp_path / "data"
    folder.mkdir()
    tokens = np.array([1, 2, 3837, 0], dtype="<u4")
    for split in ("train", "eval"):
        tokens.tofile(folder / f"{split}.u32")
    meta = {"format": "moe-train-tokens/1", "vocab_size": 3838, "eos_id": 0,
            "splits": {s: {"num_tokens": 4, "num_docs": 1} for s in ("train", "eval")}}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"vocab_size=3838, larger than model.vocab_size=2048.*--model.vocab_size=3838"):
        open_data(folder, 2048)
