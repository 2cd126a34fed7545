"""Bad input is refused before any work starts: exit status 2 and one line naming the value and what
was expected, never a traceback and never a silently accepted value."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from moe_train.cli import main
from moe_train.config import ConfigError, validate
from moe_train.config_io import build_config, config_from_dict


def error_line(capsys, argv: list[str]) -> str:
    """The CLI in-process: exit status 2 and exactly one line on stderr, which is returned."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A data folder of a few short documents (a train split of some 60 tokens, vocab <= 300)."""
    from moe_train.data import prepare_data

    docs = [f"doc {i} hello world foo bar\n" for i in range(8)]
    return prepare_data(docs, tmp_path_factory.mktemp("small") / "data", vocab_size=300, source="test")


def train_args(data, tmp_path, *more: str) -> list[str]:
    return ["train", f"--data.path={data}", "--model.vocab_size=300", f"--train.run_dir={tmp_path}/run",
            "--train.progress=false", *more]


@pytest.mark.parametrize("override,message", [
    ("--train.steps=inf", "train.steps='inf': expected an integer"),
    ("--train.steps=1e400", "train.steps='1e400': expected an integer"),
    ("--parallel.collective_timeout_s=inf", "parallel.collective_timeout_s=inf: expected a finite number"),
    ("--train.lr=inf", "train.lr=inf: expected a finite number"),
    ("--model.head_dim=0", "model.head_dim=0: expected a positive integer (or null"),
    ("--model.head_dim=-2", "model.head_dim=-2: expected a positive integer"),
    ("--model.norm_eps=0", "model.norm_eps=0.0: expected a positive number"),
    ("--model.norm_eps=-1e-6", "model.norm_eps=-1e-06: expected a positive number"),
    ("--model.rope_theta=0", "model.rope_theta=0.0: expected a positive number"),
    ("--model.init_std=-0.02", "model.init_std=-0.02: expected a positive number"),
    ("--data.seed=-1", "data.seed=-1: expected an integer >= 0"),
    ("--train.seed=-1", "train.seed=-1: expected an integer >= 0"),
    ("--data.default_vocab_size=0", "data.default_vocab_size=0: expected a positive integer"),
    ("--train.beta2=1", "train.beta2=1.0: expected in [0, 1)"),
    ("--train.eps=0", "train.eps=0.0: expected > 0"),
    ("--train.weight_decay=-0.1", "train.weight_decay=-0.1: expected >= 0"),
    ("--train.threads=-1", "train.threads=-1: expected >= 0"),
    ("--data.path=null", "data.path='null': expected a string; this field cannot be null"),
    ("--train.run_dir=", "train.run_dir='': expected a non-empty path"),
    ("--train.eval_batches=4", "train.eval_batches was removed: renamed to train.eval_windows"),
    ("--train.compile=maybe", "train.compile='maybe': expected true or false"),
])
def test_bad_override_exits_2_naming_field_value_and_expectation(override, message, capsys):
    assert message in error_line(capsys, ["info", override])


@pytest.mark.parametrize("text,message", [
    ("train:\n  steps: .inf\n", "train.steps=inf: expected an integer"),
    ("train:\n  steps: .nan\n", "train.steps=nan: expected an integer"),
    ("parallel:\n  collective_timeout_s: .inf\n", "parallel.collective_timeout_s=inf: expected a finite number"),
    ("train:\n\tsteps: 3\n", "invalid YAML at line 2, column 1: found character '\\t' that cannot start any token"),
    ("train: [\n", "invalid YAML at line 2"),
    ("train:\n  run_dir:\n", "train.run_dir: the value is empty (YAML reads it as null; config file"),
    ("data:\n  path: ~\n", "data.path=None: expected a string; this field cannot be null"),
    ("data:\n  path: [a, b]\n", "data.path=['a', 'b']: expected a string"),
    ("train:\n  eval_batches: 4\n", "train.eval_batches was removed"),
])
def test_bad_yaml_exits_2_naming_the_field_or_the_file_and_line(text, message, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    line = error_line(capsys, ["info", "--config", str(path)])
    assert message in line
    if "YAML" in message:
        assert str(path) in line


def test_a_yaml_syntax_error_is_one_line_in_a_real_process(tmp_path):
    (tmp_path / "c.yaml").write_text("model:\n  num_experts: 4\n\tsteps: 3\n")
    r = subprocess.run([sys.executable, "-m", "moe_train", "info", "--config", "c.yaml"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "moe-train: error: config file 'c.yaml': invalid YAML at line 3, column 1: "
        "found character '\\t' that cannot start any token"], r.stderr


def test_python_built_config_with_infinite_or_mistyped_values_is_refused():
    cfg = build_config("tiny")
    cfg.train.steps = math.inf
    with pytest.raises(ConfigError, match="train.steps=inf: expected an integer"):
        validate(cfg)
    cfg = build_config("tiny")
    cfg.parallel.collective_timeout_s = math.inf
    with pytest.raises(ConfigError, match="parallel.collective_timeout_s=inf: expected a finite number"):
        validate(cfg)
    cfg = build_config("tiny")
    cfg.train.run_dir = None
    with pytest.raises(ConfigError, match="train.run_dir=None: expected a string"):
        validate(cfg)


def test_a_stored_config_with_a_removed_field_still_loads():
    """Checkpoints written before train.eval_batches was renamed hold it; export-hf reads their config."""
    stored = build_config("tiny").to_dict()
    stored["train"]["eval_batches"] = 4
    assert config_from_dict(stored).train.steps == 300


@pytest.mark.parametrize("meta,message", [
    ("{bad", "not valid JSON"),
    ("[1, 2]", "holds a list, expected a JSON object"),
    ('{"format": "moe-train-tokens/1", "eos_id": 0, "splits": {}}', "vocab_size=(missing), expected an integer >= 0"),
    ('{"format": "moe-train-tokens/1", "vocab_size": "300", "eos_id": 0}', "vocab_size='300', expected an integer"),
    ('{"format": "moe-train-tokens/1", "vocab_size": 300, "eos_id": 0, "splits": [1]}',
     "splits.train.num_tokens=(missing), expected an integer >= 0"),
    ('{"format": "moe-train-tokens/1", "vocab_size": 300, "eos_id": 0, '
     '"splits": {"train": {"num_tokens": 63}, "eval": {"num_tokens": true}}}',
     "splits.eval.num_tokens=True, expected an integer >= 0"),
])
def test_malformed_meta_json_exits_2_naming_the_file(meta, message, small_data, tmp_path, capsys):
    data = shutil.copytree(small_data, tmp_path / "data")
    (data / "meta.json").write_text(meta)
    line = error_line(capsys, train_args(data, tmp_path))
    assert f"{data / 'meta.json'}: " in line and message in line


def test_meta_json_that_is_not_utf8_exits_2(small_data, tmp_path, capsys):
    data = shutil.copytree(small_data, tmp_path / "data")
    (data / "meta.json").write_bytes(b"\xff\xfe")
    assert "meta.json: not valid JSON" in error_line(capsys, train_args(data, tmp_path))


def test_a_train_split_shorter_than_one_window_exits_2_naming_its_size(small_data, tmp_path, capsys):
    n = json.loads((small_data / "meta.json").read_text())["splits"]["train"]["num_tokens"]
    line = error_line(capsys, train_args(small_data, tmp_path, f"--data.seq_len={n}"))
    assert f"the train split ({small_data / 'train.u32'}) has {n} tokens" in line
    assert f"data.seq_len+1={n + 1}" in line
    assert not (tmp_path / "run").exists()


def test_an_empty_eval_split_exits_2(small_data, tmp_path, capsys):
    data = shutil.copytree(small_data, tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["eval"]["num_tokens"] = 0
    (data / "meta.json").write_text(json.dumps(meta))
    (data / "eval.u32").write_bytes(b"")
    assert "the eval split has 0 tokens" in error_line(capsys, train_args(data, tmp_path, "--data.seq_len=8"))


def test_inspect_of_a_file_exits_2_saying_what_it_expects(tmp_path, capsys):
    f = tmp_path / "metrics.jsonl"
    f.write_text("{}\n")
    line = error_line(capsys, ["inspect", str(f)])
    assert f"{str(f)!r} is a file: expected a checkpoint folder" in line


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "bench --steps=0: expected a positive integer"),
    (["--steps", "-3"], "bench --steps=-3: expected a positive integer"),
    (["--warmup", "-1"], "bench --warmup=-1: expected an integer >= 0"),
])
def test_bench_refuses_a_step_count_it_cannot_time(args, message, capsys):
    # dense_layers=[]: tiny's [0] would leave a one-layer model no MoE layer, which warns (QA 111)
    assert message in error_line(capsys, ["bench", *args, "--model.num_layers=1", "--model.dense_layers=[]",
                                          "--data.seq_len=16"])


def test_a_run_stopped_by_non_finite_losses_exits_1_with_one_line(capsys, small_data, tmp_path):
    """Weights of 1e38 overflow fp32 in the first forward: every step is non-finite, and the run
    stops after train.max_skipped_steps of them with one line (exit 1: the input was valid)."""
    argv = train_args(small_data, tmp_path, "--model.init_std=1e38", "--train.max_skipped_steps=2", "--train.steps=5",
                      "--train.warmup_steps=1", "--data.seq_len=8", "--train.micro_batch_size=1",
                      "--train.eval_interval=0", "--train.save_interval=0")
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-train: training stopped:") and "non-finite" in lines[0], lines
    end = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "end" and end["status"] == "failed" and "TrainingError" in end["error"], end
