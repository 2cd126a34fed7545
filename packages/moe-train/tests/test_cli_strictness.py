"""What the command line must not take silently: a field or option given twice, an abbreviated option,
an override whose value was forgotten; and what it must say: its versions, and why inspect finds nothing."""

import json
from importlib.metadata import version

import pytest
import torch

from moe_train.cli import main


def exit_status(argv) -> int:
    """main's status, or the status argparse exits with."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.fixture
def nothing_runs(monkeypatch):
    """A command that reaches its work fails the test: each case here must be refused before."""
    for target in ("moe_train.trainer.loop.Trainer", "moe_train.bench.run_bench", "moe_train.data.prepare_data",
                   "moe_train.hf_bridge.export_hf"):
        monkeypatch.setattr(target, lambda *a, target=target, **k: pytest.fail(f"reached {target}"))


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize("overrides,message", [
    (["--train.steps=5", "--train.steps=7"], "train.steps is set twice (5, then 7)"),
    (["--train.steps", "5", "--train.steps", "7"], "train.steps is set twice (5, then 7)"),
    (["--train.steps", "5", "--train.steps=7"], "train.steps is set twice (5, then 7)"),
    (["--train.steps=5", "--train.steps=5"], "train.steps is set twice (5, then 5)"),
    (["--steps", "5", "--train.steps=7"], "train.steps is set twice (5, then 7)"),
    (["--run-dir", "a", "--train.run_dir=b"], "train.run_dir is set twice (a, then b)"),
    (["--save-interval=3", "--train.save_interval", "4"], "train.save_interval is set twice (3, then 4)"),
    (["--resume", "--no-resume"], "train.resume is set twice (true, then false)"),
    (["--resume=false", "--train.resume=true"], "train.resume is set twice (false, then true)"),
    (["--train={steps: 5}", "--train.steps=7"], "train.steps is set twice (5 in --train, then 7)"),
    (["--model.router.top_k=4", "--model.router={top_k: 3}"],
     "model.router.top_k is set twice (4, then 3 in --model.router)"),
])
def test_an_override_given_twice_is_refused_naming_the_field_and_both_values(overrides, message, capsys):
    assert exit_status(["info", *overrides]) == 2
    line = one_line_error(capsys)
    assert message in line and "set it once" in line, line
    assert capsys.readouterr().out == ""


def test_train_with_a_field_given_twice_starts_nothing(tmp_path, monkeypatch, nothing_runs, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_status(["train", "--train.steps=1", "--steps", "2"]) == 2
    assert "train.steps is set twice (1, then 2)" in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_an_override_may_replace_a_yaml_value_or_another_field_but_not_itself(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train:\n  steps: 5\n")
    base = ["info", "--config", str(tmp_path / "c.yaml"), "--train.steps=7", "--model.router={gating: sigmoid}",
            "--model.router.top_k=4"]
    assert main(base) == 0
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert cfg["train"]["steps"] == 7 and cfg["model"]["router"]["gating"] == "sigmoid"
    assert cfg["model"]["router"]["top_k"] == 4
    assert exit_status([*base, "--train.steps=8"]) == 2
    assert "train.steps is set twice (7, then 8)" in one_line_error(capsys)


@pytest.mark.parametrize("text,message", [
    ("train:\n  steps: 5\ntrain.steps: 7\n", "train.steps is set twice (5 in train:, then 7)"),
    ("model.router:\n  top_k: 3\nmodel:\n  router:\n    top_k: 4\n",
     "model.router.top_k is set twice (3 in model.router:, then 4 in model:)"),
])
def test_a_config_file_setting_a_field_under_two_keys_is_refused(text, message, tmp_path, capsys):
    """A key twice in one mapping is refused with its lines (test_config_strict); these are two keys."""
    (tmp_path / "c.yaml").write_text(text)
    assert exit_status(["info", "--config", str(tmp_path / "c.yaml")]) == 2
    assert f"config file {str(tmp_path / 'c.yaml')!r}: {message}: set it once" in one_line_error(capsys)


def test_build_config_refuses_a_field_set_by_a_section_mapping_and_by_its_own_key():
    from moe_train.config import ConfigError
    from moe_train.config_io import build_config

    with pytest.raises(ConfigError, match=r"model\.num_experts is set twice \(4 in --model, then 8\)"):
        build_config("tiny", overrides={"model": {"num_experts": 4}, "model.num_experts": 8})


@pytest.mark.parametrize("args,message", [
    (["info", "--preset", "tiny", "--preset", "olmo3-bench-e8"],
     "argument --preset: given twice (tiny, then olmo3-bench-e8)"),
    (["info", "--config", "a.yaml", "--config=b.yaml"], "argument --config: given twice (a.yaml, then b.yaml)"),
    (["bench", "--steps", "3", "--steps", "4"], "argument --steps: given twice (3, then 4)"),
    (["bench", "--warmup=1", "--warmup=2"], "argument --warmup: given twice (1, then 2)"),
    (["export-hf", "run", "out", "--dtype", "bf16", "--dtype", "fp32"],
     "argument --dtype: given twice (bf16, then fp32)"),
    (["prepare-data", "--out", "a", "--out", "b"], "argument --out: given twice (a, then b)"),
])
def test_an_option_given_twice_is_refused_with_both_values(args, message, tmp_path, monkeypatch, nothing_runs, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_status(args) == 2
    line = one_line_error(capsys)
    assert message in line and "pass it once" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [
    (["info", "--pre", "olmo3-bench-e8"], "unknown config key 'pre'"),
    (["info", "--pre=olmo3-bench-e8"], "unknown config key 'pre'"),
    (["info", "--conf", "c.yaml"], "unknown config key 'conf'"),
    (["bench", "--st", "3"], "unknown config key 'st'"),
    (["bench", "--warm=1"], "unknown config key 'warm'"),
    (["export-hf", "run", "out", "--dt", "fp32"], "unknown arguments ['--dt', 'fp32']"),
    (["export-hf", "run", "out", "--allow"], "unknown arguments ['--allow']"),
    (["prepare-data", "--out", "d", "--vocab", "300"], "unknown arguments ['--vocab']"),
    (["prepare-data", "--o", "d"], "the following arguments are required: --out"),
    (["--he"], "expected a command"),
    (["--vers"], "expected a command"),
])
def test_abbreviated_options_are_refused(args, message, tmp_path, monkeypatch, nothing_runs, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_status(args) == 2
    assert message in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_an_override_whose_value_was_forgotten_does_not_take_the_next_option(capsys):
    assert exit_status(["info", "--train.run_dir", "--resume"]) == 2
    line = one_line_error(capsys)
    assert "override '--train.run_dir': expected a value, got the option '--train.resume=true'" in line, line


def test_version_names_all_five_packages_torch_and_triton(capsys):
    assert exit_status(["--version"]) == 0
    out = capsys.readouterr().out.splitlines()
    names = ["moe-train", "moe-kernels", "moe-parallel", "moe-ckpt", "moe-precision", "torch", "triton"]
    assert [line.split()[0] for line in out] == names
    for line in out:
        name, shown = line.split()
        assert shown == (torch.__version__ if name == "torch" else version(name))  # torch's with its CUDA build


@pytest.mark.parametrize("command", ["train", "bench", "info", "prepare-data", "export-hf"])
def test_version_after_a_command_prints_the_versions(command, nothing_runs, capsys):
    """`moe-train train --version` was refused as an override named "version" with no value."""
    assert exit_status([command, "--version"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"moe-train {version('moe-train')}"


@pytest.mark.parametrize("override,message", [
    ("--model.num_experts=", "override --model.num_experts=: the value is empty; expected an integer"),
    ("--model.head_dim=", "override --model.head_dim=: the value is empty; expected an integer (`null` for none)"),
    ("--train.lr= ", "override --train.lr= : the value is empty; expected a number"),
    ("--model.dense_layers=", "the value is empty; expected a list like [0, 1] ([] for none)"),
    ("--train.resume=", "the value is empty; expected true or false"),
])
def test_an_empty_override_names_what_the_field_expects(override, message, nothing_runs, capsys):
    """An empty value was read as YAML's null: "model.num_experts=None: expected an integer" named a None nobody typed."""
    assert exit_status(["train", override]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("command", ["inspect", "export-hf"])
@pytest.mark.parametrize("layout", ["metrics_only", "empty_checkpoints", "partial_save"])
def test_a_run_without_checkpoints_is_named_in_one_line(command, layout, tmp_path, nothing_runs, capsys):
    run = tmp_path / "run"
    run.mkdir()
    if layout == "metrics_only":  # a run before its first save: checkpoints/ comes with it
        (run / "metrics.jsonl").write_text('{"event": "start"}\n')
    elif layout == "empty_checkpoints":
        (run / "checkpoints").mkdir()
    else:
        (run / "checkpoints" / "step-00000010.tmp").mkdir(parents=True)
    argv = [command, str(run)] + ([str(tmp_path / "hf")] if command == "export-hf" else [])
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert f"run {str(run)!r} has no checkpoints yet" in line, line
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("command,what,message", [
    ("inspect", "missing", "does not exist: expected a checkpoint folder"),
    ("export-hf", "missing", "does not exist: expected a run folder, a checkpoint folder"),
    ("inspect", "file", "is a file: expected a checkpoint folder"),
    ("inspect", "empty_folder", "holds no checkpoint (no index.json, checkpoints/ or metrics.jsonl)"),
])
def test_inspect_and_export_of_what_is_no_run_name_it(command, what, message, tmp_path, nothing_runs, capsys):
    path = tmp_path / what
    if what == "file":
        path.write_text("x")
    elif what == "empty_folder":
        path.mkdir()
    argv = [command, str(path)] + ([str(tmp_path / "hf")] if command == "export-hf" else [])
    assert main(argv) == 2
    assert f"{str(path)!r} {message}" in one_line_error(capsys)


@pytest.mark.parametrize("overrides,message", [
    (["--train.steps=100"], "bench --train.steps=100: bench does not read train.steps (its measured steps are "
                            "--steps N)"),
    (["--run-dir", "elsewhere"], "bench --train.run_dir=elsewhere: bench does not read train.run_dir"),
    (["--resume"], "bench --train.resume=true: bench does not read train.resume"),
    (["--save-interval", "3"], "bench --train.save_interval=3: bench does not read train.save_interval"),
    (["--train.init_from=runs/a"], "bench --train.init_from=runs/a: bench does not read train.init_from (it times a "
                                   "randomly initialised model)"),
])
def test_bench_refuses_a_training_runs_own_fields_it_would_ignore(overrides, message, nothing_runs, capsys):
    assert exit_status(["bench", *overrides]) == 2
    assert message in one_line_error(capsys)


def test_bench_help_lists_no_shorthands_it_would_ignore(capsys):
    assert exit_status(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Shorthands" not in text and "--train.steps, --train.run_dir, --train.resume" in text


@pytest.mark.parametrize("args,named", [
    (["info", "--config", ""], "argument --config"),
    (["bench", "--out="], "argument --out"),
    (["inspect", ""], "argument checkpoint"),
    (["export-hf", "run", ""], "argument out"),
    (["export-hf", "", "out"], "argument checkpoint"),
    (["import-hf", "", "out"], "argument folder"),
    (["import-hf", "hf", ""], "argument out"),
    (["prepare-data", "--out", ""], "argument --out"),
    (["prepare-data", "", "--out", "d"], "argument inputs"),
    (["prepare-data", "a.txt", "--out", "d", "--tokenizer", ""], "argument --tokenizer"),
])
def test_an_empty_path_is_refused_not_taken_as_the_current_folder_or_none(args, named, tmp_path, monkeypatch,
                                                                           nothing_runs, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world. " * 50)
    assert exit_status(args) == 2
    assert f"{named}: expected a path, got an empty string" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_an_empty_hub_repo_is_refused_not_taken_as_no_upload(nothing_runs, capsys):
    assert exit_status(["export-hf", "run", "out", "--push-to-hub="]) == 2
    assert "argument --push-to-hub: expected a Hub repo id" in one_line_error(capsys)


def test_an_empty_preset_or_config_path_is_refused_not_taken_as_the_default(capsys):
    from moe_train.config import ConfigError
    from moe_train.config_io import build_config

    assert exit_status(["info", "--preset="]) == 2
    assert "preset='': expected one of tiny," in one_line_error(capsys)
    with pytest.raises(ConfigError, match="config file '': expected the path of a YAML file"):
        build_config(yaml_path="")


@pytest.mark.parametrize("arg", ["--", "--=3"])
def test_an_override_without_a_key_says_what_an_override_is(arg, capsys):
    assert exit_status(["info", arg, "--train.steps=3"]) == 2
    assert f"override {arg!r}: expected --section.field=value" in one_line_error(capsys)


def test_train_prints_its_summary_from_the_main_rank_only(tmp_path, monkeypatch, capsys):
    """Under torchrun every rank runs main: one summary line, not one per rank."""
    monkeypatch.chdir(tmp_path)

    class OneRank:
        is_main = False

        def __init__(self, cfg):
            pass

        def train(self):
            return {"step": 1}

    monkeypatch.setattr("moe_train.trainer.loop.Trainer", OneRank)
    assert main(["train"]) == 0
    assert capsys.readouterr().out == ""
    OneRank.is_main = True
    assert main(["train"]) == 0
    assert json.loads(capsys.readouterr().out) == {"step": 1}


def test_version_of_a_package_run_from_source_is_its_modules(monkeypatch, capsys):
    """tools/gpu_env.sh runs the packages from src/ without installing them: no package metadata."""
    import importlib.metadata

    import moe_kernels

    real = importlib.metadata.version

    def without_moe_kernels(name):
        if name == "moe-kernels":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", without_moe_kernels)
    assert exit_status(["--version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"moe-kernels {moe_kernels.__version__} (from source, not installed)" in out
    assert f"moe-train {real('moe-train')}" in out
