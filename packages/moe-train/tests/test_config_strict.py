"""Config values are taken exactly as written or refused in one line (exit 2): YAML's silent rewrites
(octal paths, duplicate keys), integers past what torch or datetime take, and integers rounded
through float. A checkpoint's stored config is checked only where export reads it."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from moe_train.cli import main
from moe_train.config import INT64_MAX, MAX_COLLECTIVE_TIMEOUT_S, Config, DataConfig, ModelConfig, TrainConfig
from metadata_edit import rewrite_metadata  # noqa: E402


def cli(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_train", *argv], capture_output=True, text=True, cwd=cwd)


def error_line(capsys, argv: list[str]) -> str:
    """The CLI in-process: exit status 2 and exactly one line on stderr, which is returned."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def resolved(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["config"]


# -- a stored config is checked where export reads it --------------------------------------

@pytest.fixture(scope="module")
def exportable_run(tmp_path_factory):
    """A one-step run of a Qwen3-MoE-shaped model (softmax, per-head QK-norm, no shared expert)."""
    from moe_train.data import prepare_data
    from moe_train.trainer.loop import Trainer

    tmp = tmp_path_factory.mktemp("run")
    data = prepare_data([f"doc {i} hello world foo bar\n" for i in range(40)], tmp / "data", vocab_size=300,
                        source="test")
    Trainer(Config(
        model=ModelConfig(vocab_size=300, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                          dense_hidden=64, dense_layers=[0], num_experts=4, expert_hidden=16),
        data=DataConfig(path=str(data), seq_len=16),
        train=TrainConfig(steps=1, micro_batch_size=4, eval_interval=0, save_interval=1, run_dir=str(tmp / "run"),
                          progress=False, device="cpu"),
    )).train()
    return tmp / "run"


def stored_config_edited(run, tmp_path, edit) -> str:
    """A copy of `run` whose checkpoint metadata's config went through `edit` (as an older release wrote it)."""
    import shutil

    from moe_ckpt import find_latest

    copy = shutil.copytree(run, tmp_path / "run")
    meta_file = find_latest(copy / "checkpoints") / "metadata.json"
    meta = json.loads(meta_file.read_text())
    edit(meta["config"])
    rewrite_metadata(meta_file, meta)
    return str(copy)


def test_export_hf_and_inspect_read_a_run_whose_stored_training_fields_this_release_refuses(
        exportable_run, tmp_path, capsys):
    """0.3.0 took train.threads=-1; 0.4.0 refuses it for training, yet export needs only the model."""
    def older_release(c):
        c["train"].update(threads=-1, steps=0, compile=False)
        c["parallel"]["collective_timeout_s"] = 1e14
        c["data"]["eval_fraction"] = 2.0

    run = stored_config_edited(exportable_run, tmp_path, older_release)
    r = cli("export-hf", run, str(tmp_path / "hf"), "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert main(["inspect", run]) == 0
    assert "step: 1" in capsys.readouterr().out


def test_export_hf_of_a_stored_config_with_an_invalid_model_field_names_the_field(exportable_run, tmp_path, capsys):
    run = stored_config_edited(exportable_run, tmp_path, lambda c: c["model"].update(num_kv_heads=3))
    line = error_line(capsys, ["export-hf", run, str(tmp_path / "hf")])
    assert "stored config: model.num_kv_heads=3: expected a divisor of model.num_heads=4" in line
    assert f"checkpoint '{run}/checkpoints/step-00000001'" in line


# -- YAML scalars for string fields are taken as typed or refused --------------------------

def test_an_unquoted_yaml_number_for_a_path_exits_2_saying_to_quote_it(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  run_dir: 0710\n")
    r = cli("info", "--config", "c.yaml", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        'moe-train: error: train.run_dir: YAML read 0710 as the number 456; quote it: run_dir: "0710"'], r.stderr


@pytest.mark.parametrize("text,read_as", [
    ("12:30", "the number 750"),  # YAML 1.1 sexagesimal
    ("0x1F", "the number 31"),
    ("1_000", "the number 1000"),
    ("1.50", "the number 1.5"),
    ("2024", "the number 2024"),
    ("yes", "the boolean true"),
    ("2024-01-01", "the date 2024-01-01"),
])
def test_unquoted_yaml_scalars_that_are_not_strings_are_refused_for_string_fields(text, read_as, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(f"data:\n  path: {text}\n")
    line = error_line(capsys, ["info", "--config", str(tmp_path / "c.yaml")])
    assert line == f'moe-train: error: data.path: YAML read {text} as {read_as}; quote it: path: "{text}"'


def test_quoted_yaml_and_command_line_strings_are_kept_as_typed(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text('preset: tiny\ntrain:\n  run_dir: "0710"\ndata:\n  cache_dir: \'12:30\'\n')
    cfg = resolved(capsys, ["info", "--config", str(tmp_path / "c.yaml"), "--data.path=0x1F"])
    assert (cfg["train"]["run_dir"], cfg["data"]["cache_dir"], cfg["data"]["path"]) == ("0710", "12:30", "0x1F")
    assert resolved(capsys, ["info", "--train.run_dir=0710"])["train"]["run_dir"] == "0710"


# -- integers stay exact, and values torch or datetime cannot take are refused up front ----

def test_a_yaml_integer_past_2_to_the_53_stays_exact(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train:\n  keep_last: 9007199254740993\n  max_skipped_steps: 9223372036854775807\n")
    cfg = resolved(capsys, ["info", "--config", str(tmp_path / "c.yaml"), "--train.steps=9007199254740993"])
    assert (cfg["train"]["keep_last"], cfg["train"]["max_skipped_steps"], cfg["train"]["steps"]) == (
        9007199254740993, 9223372036854775807, 9007199254740993)


@pytest.mark.parametrize("override,message", [
    ("--train.seed=18446744073709551616", "train.seed=18446744073709551616: expected an integer in [-2**63, 2**63"),
    ("--train.seed=9223372036854775808", "train.seed=9223372036854775808: expected an integer in [-2**63, 2**63 - 1]"),
    ("--data.seed=18446744073709551616", "data.seed=18446744073709551616: expected an integer in [-2**63, 2**63 - 1]"),
    ("--train.grad_accum=18446744073709551616", "train.grad_accum=18446744073709551616: expected an integer in"),
    ("--train.steps=-9223372036854775809", "train.steps=-9223372036854775809: expected an integer in"),
    ("--train.threads=2147483648", "train.threads=2147483648: expected >= 0 and <= 4096"),
    ("--parallel.collective_timeout_s=1e14",
     "parallel.collective_timeout_s=100000000000000.0: expected a positive number of seconds <= 1e7"),
    ("--model.vocab_size=4611686018427387904", "model.vocab_size=4611686018427387904: expected model.d_model=128 "
                                               "times it <= 2**48 elements in one weight"),
    ("--model.d_model=2147483648", "model.num_heads x head_dim=2147483648: expected model.d_model=2147483648 times it"),
    ("--model.num_layers=65537", "model.num_layers=65537: expected <= 65536"),
    ("--train.seed=1e20", "train.seed='1e20': expected an integer written in digits (a float this large is rounded)"),
])
def test_values_that_would_overflow_in_torch_or_datetime_exit_2_naming_the_bound(override, message, capsys):
    assert message in error_line(capsys, ["info", override])


@pytest.mark.parametrize("override,message", [
    ("--train.save_interval=-1", "train.save_interval=-1: expected >= 0 (0 disables)"),
    ("--train.eval_interval=-5", "train.eval_interval=-5: expected >= 0 (0 disables)"),
])
def test_a_negative_interval_is_named_alone(override, message, capsys):
    """It was reported as the pair `train.eval_interval/save_interval=(50, -1)`, naming neither field alone."""
    assert message in error_line(capsys, ["info", override])


def test_a_yaml_float_too_large_to_hold_an_integer_exactly_is_refused(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train:\n  seed: 9007199254740993.0\n")
    line = error_line(capsys, ["info", "--config", str(tmp_path / "c.yaml")])
    assert "train.seed=9007199254740992.0: expected an integer written in digits" in line


def test_the_largest_accepted_seed_and_timeout_are_taken_by_torch_and_datetime(capsys):
    cfg = resolved(capsys, ["info", f"--train.seed={INT64_MAX}", f"--data.seed={INT64_MAX}",
                            f"--parallel.collective_timeout_s={MAX_COLLECTIVE_TIMEOUT_S}"])
    assert cfg["train"]["seed"] == cfg["data"]["seed"] == INT64_MAX
    torch.Generator().manual_seed(cfg["train"]["seed"])
    np.random.default_rng([cfg["data"]["seed"], 0])  # the sampler's generator takes the whole integer
    datetime.timedelta(seconds=cfg["parallel"]["collective_timeout_s"])


# -- a key twice in one YAML mapping -------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("train:\n  steps: 3\n  steps: 5\n", "duplicate key 'train.steps' at line 3 (first at line 2)"),
    ("train:\n  steps: 3\nmodel:\n  d_model: 64\ntrain:\n  lr: 0.1\n",
     "duplicate key 'train' at line 5 (first at line 1)"),
    ("model:\n  router: {top_k: 1, top_k: 2}\n", "duplicate key 'model.router.top_k' at line 2 (first at line 2)"),
])
def test_a_key_written_twice_in_one_yaml_mapping_exits_2_naming_key_and_lines(text, message, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    line = error_line(capsys, ["info", "--config", str(path)])
    assert line.startswith(f"moe-train: error: config file '{path}': ") and message in line, line


def test_a_yaml_merge_key_may_be_overridden_beside_it(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train:\n  <<: {steps: 4, lr: 0.5}\n  steps: 5\n")
    cfg = resolved(capsys, ["info", "--config", str(tmp_path / "c.yaml")])
    assert (cfg["train"]["steps"], cfg["train"]["lr"]) == (5, 0.5)


@pytest.mark.parametrize("text,value", [("0710", 456), ("12:30", 750), ("-0_17", -15), ("1:30.5", 90.5)])
def test_yaml_octal_and_base_60_numbers_for_number_fields_are_refused(text, value, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(f"train:\n  steps: {text}\n  lr: {text}\n")
    line = error_line(capsys, ["info", "--config", str(tmp_path / "c.yaml")])
    assert f"train.steps: YAML 1.1 reads {text} as {value} (octal or base 60); write the number in decimal digits" in line


@pytest.mark.parametrize("text,value", [("0", 0), ("10", 10), ("1_000", 1000), ("0x10", 16), ("0.5", 0.5), ("1e3", 1000)])
def test_yaml_numbers_in_usual_forms_are_taken(text, value, tmp_path, capsys):
    field = "lr" if isinstance(value, float) else "warmup_steps"
    (tmp_path / "c.yaml").write_text(f"train:\n  {field}: {text}\n")
    assert resolved(capsys, ["info", "--config", str(tmp_path / "c.yaml")])["train"][field] == value


def test_a_seed_past_32_bits_is_taken_and_on_the_cpu_the_trainer_says_what_it_initialises_as(tmp_path, data_dir, make_config):
    import warnings

    from moe_train.trainer.loop import Trainer

    cfg = make_config(tmp_path, steps=1, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    cfg.train.seed = 2**32 + 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(cfg)
    assert any(f"train.seed={2**32 + 5}: torch's CPU generator keeps the low 32 bits" in str(w.message)
               and "initialises as train.seed=5 does" in str(w.message) for w in caught)


def test_octal_numbers_inside_yaml_lists_are_refused(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("model:\n  num_layers: 16\n  dense_layers: [0, 010]\n")
    line = error_line(capsys, ["info", "--config", str(tmp_path / "c.yaml")])
    assert "model.dense_layers: YAML 1.1 reads 010 as 8 (octal or base 60); write the number in decimal digits" in line


# -- a command-line override is read as the same value in a config file is ----------------

SAME_IN_BOTH = [  # (key, text, the field's value or the error)
    ("model.dense_layers", "0", "model.dense_layers=0: expected a list like [0, 1] ([] for none)"),
    ("model.dense_layers", "~", "model.dense_layers=None: expected a list like [0, 1] ([] for none)"),
    ("model.dense_layers", "[]", []),
    ("model.dense_layers", "[1, 3]", [1, 3]),
    ("model.dense_layers", "[0, 010]", "model.dense_layers: YAML 1.1 reads 010 as 8 (octal or base 60)"),
    ("model.head_dim", "~", None),
    ("model.head_dim", "null", None),
    ("model.head_dim", "64", 64),
    ("model.head_dim", "0", "model.head_dim=0: expected a positive integer (or null for model.d_model // "),
    ("train.steps", "010", "train.steps: YAML 1.1 reads 010 as 8 (octal or base 60); write the number in decimal"),
    # ("train.steps", "0x10"): 16 in a file, refused on the command line (test_qa111_config.py)
    ("train.steps", "~", "train.steps=None: expected an integer"),
    ("train.progress", "off", False),
    ("train.progress", "1", True),
    ("train.lr", ".inf", "train.lr=inf: expected a finite number"),
]


@pytest.mark.parametrize("key,text,expected", SAME_IN_BOTH)
def test_an_override_and_the_same_value_in_a_config_file_give_one_result(key, text, expected, tmp_path, capsys):
    section, field = key.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {field}: {text}\n")
    argvs = {"yaml": ["info", "--config", str(tmp_path / "c.yaml")], "override": ["info", f"--{key}={text}"]}
    for how, argv in argvs.items():
        if isinstance(expected, str):
            line = error_line(capsys, argv)
            assert line.startswith("moe-train: error: ") and expected in line, (how, line)
        else:
            assert resolved(capsys, argv)[section][field] == expected, how


def test_a_null_head_dim_on_the_command_line_undoes_the_config_files_and_derives_it(tmp_path):
    from moe_train.config_io import build_config, parse_overrides

    (tmp_path / "c.yaml").write_text("model:\n  head_dim: 64\n")
    cfg = build_config(None, str(tmp_path / "c.yaml"), parse_overrides(["--model.head_dim=~"]))
    assert cfg.model.head_dim is None and cfg.model.resolved_head_dim == cfg.model.d_model // cfg.model.num_heads


def test_an_override_that_is_not_yaml_names_the_override(capsys):
    line = error_line(capsys, ["info", "--model.dense_layers=[0,"])
    assert line.startswith("moe-train: error: override --model.dense_layers=[0,: invalid YAML at line 1"), line


def test_a_path_starting_with_a_tilde_means_the_home_folder_on_the_command_line_and_in_yaml(tmp_path):
    from pathlib import Path

    from moe_train.config_io import build_config

    home = str(Path.home())
    cfg = build_config(overrides={"train.run_dir": "~/runs/x", "data.cache_dir": "~/cache"})
    assert cfg.train.run_dir == f"{home}/runs/x" and cfg.data.cache_dir == f"{home}/cache"
    run = tmp_path / "run.yaml"
    run.write_text("data: {path: ~/corpus}\ntrain: {run_dir: ~/runs/y}\n")
    cfg = build_config(yaml_path=str(run))
    assert cfg.data.path == f"{home}/corpus" and cfg.train.run_dir == f"{home}/runs/y"
    assert build_config(overrides={"train.run_dir": "runs/~x"}).train.run_dir == "runs/~x"  # only a leading ~


def _start_warnings(cfg, naming: str) -> list[str]:  # noqa: ANN001
    """The messages of the warnings a Trainer built from `cfg` gives at start that contain `naming`."""
    import warnings

    from moe_train.trainer.loop import Trainer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(cfg)
    trainer.runtime.close()
    trainer._release_run_dir()
    return [str(w.message) for w in caught if naming in str(w.message)]


@pytest.mark.parametrize("warmup,warns", [(5, True), (4, False), (0, False)])
def test_a_warmup_longer_than_the_run_is_named_when_the_trainer_starts(warmup, warns, tmp_path, data_dir, make_config):
    """warmup_steps > steps was legal and silent: the lr never reached train.lr and never decayed."""
    cfg = make_config(tmp_path, steps=4, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    cfg.train.warmup_steps, cfg.train.lr = warmup, 1e-3
    named = _start_warnings(cfg, "train.warmup_steps")
    assert named == (["train.warmup_steps=5 > train.steps=4: the whole run warms up, its lr peaks at lr x 4/5 = "
                      "0.0008 (train.lr=0.001) and never decays"] if warns else [])


@pytest.mark.parametrize("factor,warns", [(1.25, True), (0.0, False)])
def test_a_capacity_that_cannot_drop_with_ep_1_is_named_when_the_trainer_starts(factor, warns, tmp_path, data_dir,
                                                                                make_config):
    """expert_capacity_factor with parallel.ep=1 was silent: the capacity is per EP rank and one rank receives exactly
    its tokens x top_k rows, so no row is ever dropped."""
    cfg = make_config(tmp_path, steps=4, eval_interval=0, save_interval=0)
    cfg.data.path = str(data_dir)
    cfg.parallel.expert_capacity_factor = factor
    named = _start_warnings(cfg, "expert_capacity_factor")
    assert named == (["parallel.expert_capacity_factor=1.25 drops nothing with parallel.ep=1: the capacity is per EP "
                      "rank (ceil(factor x the EP group's mean tokens x top_k) of the rows it receives), and a rank "
                      "that holds every expert receives exactly tokens x top_k rows"] if warns else [])
