import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from moe_train.cli import main


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moe_train", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("args,message", [
    (["train", "--model.router.top_k=99"], "model.router.top_k=99: expected 1 <= top_k <= model.num_experts=8"),
    (["train", "--model.num_kv_heads=3"], "model.num_kv_heads=3: expected a divisor of model.num_heads=4"),
    (["train", "--preset", "nope"], "preset='nope': expected one of"),
    (["info", "--model.vocab=3"], "unknown config key 'model.vocab'"),
    (["train", "--data.path=/does/not/exist"], "data.path='/does/not/exist' does not exist"),
])
def test_bad_input_exits_nonzero_with_one_line(args, message, tmp_path):
    r = run_cli(*args, f"--train.run_dir={tmp_path}/run", cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_token_ids_beyond_vocab_in_data_exit_nonzero(tmp_path, data_dir):
    r = run_cli("train", f"--data.path={data_dir}", "--model.vocab_size=100", f"--train.run_dir={tmp_path}/r", cwd=tmp_path)
    assert r.returncode == 2 and "tokenized with vocab_size=512" in r.stderr and "model.vocab_size=100" in r.stderr


def test_info_reports_counts_for_the_olmo3_preset(capsys):
    assert main(["info", "--preset", "olmo3-bench-e64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 23.8e9 < out["params_total"] < 24.8e9 and out["flops_per_token"] > 6 * 3e9


def test_bench_reports_json_on_cpu(capsys):
    assert main(["bench", "--steps", "1", "--warmup", "1", "--model.num_layers=2", "--data.seq_len=32",
                 "--train.micro_batch_size=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_s"] > 0 and out["mfu"] is None and out["model_tflops"] > 0
    assert out["runtime"] == "LocalRuntime" and out["param_dtype"] == "fp32"
    # the commit of the source that ran (the suite runs from a git clone; an installed wheel records null)
    head = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert out["commit"] is not None and out["commit"].removesuffix("-dirty") == head, (out["commit"], head)


def test_bench_runs_the_runtime_the_config_asks_for(capsys):
    """bf16 resident weights (fp32 masters in the distributed optimizer), as `train` would run them."""
    assert main(["bench", "--steps", "1", "--warmup", "1", "--model.num_layers=2", "--data.seq_len=32",
                 "--train.micro_batch_size=2", "--parallel.param_dtype=bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runtime"] == "DistributedRuntime" and out["world_size"] == 1 and out["param_dtype"] == "bf16"
    assert out["tokens_per_s"] > 0 and math.isfinite(out["final_loss"])


def test_prepare_data_command(tmp_path):
    src = tmp_path / "txt"
    src.mkdir()
    (src / "a.txt").write_text("hello world. " * 200)
    (src / "b.txt").write_text("goodbye moon. " * 200)
    r = run_cli("prepare-data", str(src), "--out", str(tmp_path / "d"), "--vocab-size", "300")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["vocab_size"] <= 300


@pytest.mark.parametrize("extra,named", [(["--vocab-size", "300", "--tokenizer", "TOK"], "--vocab-size=300"),
                                         (["--max-bytes", "1000"], "--max-bytes=1000")])
def test_prepare_data_refuses_an_option_it_would_ignore(tmp_path, capsys, extra, named):
    from moe_train.cli import main

    (tmp_path / "a.txt").write_text("hello world. " * 200)
    tok = tmp_path / "tokenizer.json"
    args = [a if a != "TOK" else str(tok) for a in extra]
    assert main(["prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d"), *args]) == 2
    err = capsys.readouterr().err
    assert named in err and "\n" not in err.strip()
    assert not (tmp_path / "d").exists()


def test_inspect_lists_tensors_and_layout(tmp_path, data_dir, make_config, capsys):
    from moe_train.trainer.loop import Trainer

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    assert main(["inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "blocks.1.mlp.experts.w_gate_up" in out and "optim.step" in out and "LocalRuntime" in out


def test_inspect_of_a_missing_checkpoint_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2


def test_impossible_layout_exits_2_with_one_line(tmp_path):
    r = run_cli("train", "--parallel.dp=2", f"--train.run_dir={tmp_path}/run", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "parallel.dp=2 x parallel.pp=1 = 2 does not equal world_size=1" in lines[0]


def test_our_warnings_print_as_one_line_and_others_as_python_shows_them(monkeypatch, capsys):
    import warnings

    from moe_train import cli

    def info_that_warns(cfg):
        warnings.warn_explicit("eval losses before and after step 3 are not comparable", UserWarning,
                               filename="/x/moe_train/trainer/loop.py", lineno=1)
        warnings.warn_explicit("a torch warning", UserWarning, filename="/x/torch/nn/modules.py", lineno=7)

    monkeypatch.setattr(cli, "_cmd_info", info_that_warns)
    assert main(["info"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "moe-train: warning: eval losses before and after step 3 are not comparable" in err
    assert not any(line.startswith("moe-train: warning: a torch warning") for line in err)
    assert warnings.showwarning is not cli._show_warning  # restored after main


def test_inspect_into_a_pipe_closed_early_exits_quietly(tmp_path, data_dir, make_config):
    from moe_train.trainer.loop import Trainer

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=1)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()
    proc = subprocess.run(f"{sys.executable} -m moe_train.cli inspect {tmp_path / 'run'} | head -c 10",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert len(proc.stdout) == 10 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("word,value", [("on", True), ("off", False), ("yes", True), ("no", False), ("0", False)])
def test_boolean_overrides_take_the_words_yaml_does(word, value, capsys):
    assert main(["info", f"--train.progress={word}"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["train"]["progress"] is value
