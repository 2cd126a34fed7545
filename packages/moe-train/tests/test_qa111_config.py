"""QA 111: config leniencies.

1. A number or boolean typed on the command line took whatever YAML or Python's int() / float() read:
   --model.d_model=５ (a full-width digit) was 5, --train.steps=0x10 16, 0b101 5, 1_000 1000, and
   --train.compile=-0 false. The command line now takes decimal ASCII only (README "Config"); a YAML file keeps
   YAML's numbers, and a YAML string for a number field is held to the command line's spelling.
2. A layout that does not fit the launched world was refused in moe-parallel's names (`dp=3 x pp=1 ...; set dp=2`)
   while the user typed parallel.dp: moe-train's refusal names parallel.dp / ep / pp and the fix in those names.
3. A dense model (model.num_experts=0) took expert and router fields without a word, and so did an MoE model whose
   model.dense_layers list every layer: both warn once, naming what has no effect.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from moe_parallel import ParallelLayout
from test_config_strict import error_line, resolved
from moe_train.cli import main
from moe_train.config import ConfigError, RouterConfig
from moe_train.config_io import build_config
from moe_train.presets import PRESETS, tiny
from moe_train.trainer import launch

INT_EXPECTED = "expected an integer in decimal ASCII digits with an optional sign (1000, -3; 1e3 is 1000)"
FLOAT_EXPECTED = "expected a number in decimal ASCII notation (0.003, 3e-3, 2)"
BOOL_EXPECTED = "expected true or false (or yes/no, on/off, 1/0)"


# -- 1. command-line text for number and boolean fields ---------------------------------------------------------

@pytest.mark.parametrize("override,shown,expected", [
    ("--model.d_model=５", "model.d_model='５'", INT_EXPECTED),  # int() reads full-width digits
    ("--train.steps=0x10", "train.steps=0x10", INT_EXPECTED),  # YAML 1.1's hexadecimal
    ("--train.steps=0b101", "train.steps=0b101", INT_EXPECTED),  # YAML 1.1's binary
    ("--train.steps=1_000", "train.steps=1_000", INT_EXPECTED),
    ("--model.head_dim=0x20", "model.head_dim=0x20", INT_EXPECTED),  # an optional integer too
    ("--train.compile=-0", "train.compile=-0", BOOL_EXPECTED),  # YAML's integer 0
    ("--train.resume=+1", "train.resume=+1", BOOL_EXPECTED),
    ("--train.progress=0x0", "train.progress=0x0", BOOL_EXPECTED),
    ("--train.lr=３e-3", "train.lr='３e-3'", FLOAT_EXPECTED),  # float() reads full-width digits
    ("--train.lr=1_0.5", "train.lr=1_0.5", FLOAT_EXPECTED),
    ("--train.grad_clip=0x1", "train.grad_clip=0x1", FLOAT_EXPECTED),
])
def test_a_number_or_boolean_on_the_command_line_beyond_decimal_ascii_is_one_line_naming_field_and_text(
        capsys, override, shown, expected):
    assert error_line(capsys, ["info", override]) == f"moe-train: error: {shown}: {expected}"


def test_the_command_lines_plain_spellings_are_taken_and_hex_is_refused_through_build_config_too(capsys):
    cfg = resolved(capsys, ["info", "--train.steps=+8", "--data.seed=-0", "--train.warmup_steps=1e3",
                            "--train.compile=TRUE", "--train.progress=off", "--train.resume=1", "--train.lr=3e-3",
                            "--train.grad_clip=.5", "--model.head_dim=none"])
    assert (cfg["train"]["steps"], cfg["data"]["seed"], cfg["train"]["warmup_steps"]) == (8, 0, 1000)
    assert (cfg["train"]["compile"], cfg["train"]["progress"], cfg["train"]["resume"]) == (True, False, True)
    assert (cfg["train"]["lr"], cfg["train"]["grad_clip"], cfg["model"]["head_dim"]) == (3e-3, 0.5, None)
    # build_config reads a string override as the command line's text
    with pytest.raises(ConfigError, match=r"^train\.steps=0x10: expected an integer in decimal ASCII digits"):
        build_config("tiny", overrides={"train.steps": "0x10"})


@pytest.mark.parametrize("line,shown", [
    ('d_model: "５"', "model.d_model='５'"),
    ("d_model: ５", "model.d_model='５'"),  # YAML reads it as a string, and int() read it as 5
    ('num_layers: "1_000"', "model.num_layers='1_000'"),
    ('num_layers: " 2"', "model.num_layers=' 2'"),
])
def test_a_yaml_string_for_an_integer_field_is_held_to_the_command_lines_spelling(capsys, tmp_path, line, shown):
    (tmp_path / "c.yaml").write_text(f"model:\n  {line}\n")
    assert error_line(capsys, ["info", "--config", str(tmp_path / "c.yaml")]) == f"moe-train: error: {shown}: " \
                                                                                  f"{INT_EXPECTED}"
    # YAML's own numbers stay numbers in a file, and a quoted decimal is taken
    (tmp_path / "c.yaml").write_text('model:\n  d_model: "64"\ntrain:\n  steps: 0x10\n  warmup_steps: 1_000\n')
    cfg = resolved(capsys, ["info", "--config", str(tmp_path / "c.yaml")])
    assert (cfg["model"]["d_model"], cfg["train"]["steps"], cfg["train"]["warmup_steps"]) == (64, 16, 1000)


# -- 2. a layout that does not fit the launched world, in the config's names ------------------------------------

def runtime_refusal(monkeypatch, world: int, num_experts: int = 8, **parallel) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    cfg = tiny()
    cfg.model.num_experts = num_experts
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    with pytest.raises(ConfigError) as e:
        launch.make_runtime(cfg, torch.device("cpu"))
    return str(e.value)


def test_a_layout_that_does_not_fit_the_world_names_parallel_fields_and_the_fix(monkeypatch):
    assert runtime_refusal(monkeypatch, 2, dp=3) == (
        "parallel layout: parallel.dp=3 x parallel.pp=1 = 3 does not equal world_size=2 (the processes launched, "
        "WORLD_SIZE); set parallel.dp=2, or launch 3 processes")
    assert runtime_refusal(monkeypatch, 3, dp=1, pp=2).endswith(
        "no parallel.dp fits parallel.pp=2: set parallel.pp to a divisor of 3, or launch 2 processes")
    # a Config built by hand skips validate's ep checks: moe-parallel's refusal is given in the config's names
    assert runtime_refusal(monkeypatch, 4, dp=4, ep=3) == (
        "parallel layout: parallel.ep=3 does not divide parallel.dp=4 (expert parallelism is folded over the "
        "data-parallel ranks)")
    assert runtime_refusal(monkeypatch, 2, num_experts=0, dp=2, ep=2).endswith(
        "with a dense model (model.num_experts=0): there are no experts to split over expert-parallel ranks; use "
        "parallel.ep=1")
    # the library keeps its own names for its own callers
    with pytest.raises(ValueError, match=r"^parallel layout: dp=3 x pp=1 = 3 does not equal world_size=2; set dp=2 "):
        ParallelLayout(3, 1, 1).validate(2, 8)


def test_train_with_a_layout_larger_than_the_world_exits_2_naming_parallel_dp(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    line = error_line(capsys, ["train", "--parallel.dp=2", f"--train.run_dir={tmp_path / 'run'}",
                               f"--data.cache_dir={tmp_path / 'cache'}"])
    assert line.startswith("moe-train: error: parallel layout: parallel.dp=2 x parallel.pp=1 = 2 does not equal "
                           "world_size=1 (the processes launched, WORLD_SIZE); set parallel.dp=1"), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


# -- 3. expert and router fields a model never reads --------------------------------------------------------------

def no_warning(**kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_config(**kwargs)


ROUTER_VALUES = dict(gating="sigmoid", top_k=3, normalize_top_k=False, routing="random", lb_loss_weight=0.5,
                     lb_loss_scope="global", z_loss_weight=0.5, expert_bias=True, expert_bias_rate=0.5,
                     routed_scaling_factor=2.5)


def test_a_dense_model_warns_once_naming_every_expert_and_router_field_it_was_given():
    assert set(ROUTER_VALUES) == {f.name for f in dataclasses.fields(RouterConfig)}  # every router field
    overrides = {"model.num_experts": "0", "model.expert_hidden": "256", "model.shared_expert_hidden": "64",
                 "model.shared_expert_gate": "true", "model.dense_layers": "[1]"}
    overrides.update({f"model.router.{k}": str(v).lower() for k, v in ROUTER_VALUES.items()})
    with pytest.warns(UserWarning) as caught:
        build_config("tiny", overrides=overrides)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for key in [k for k in overrides if k != "model.num_experts"]:
        assert f"{key}=" in message, (key, message)
    assert "no effect with model.num_experts=0, a dense model" in message
    assert "set model.num_experts > 0 for an MoE model" in message
    # the preset's values and ModelConfig's defaults are nobody's choice: a preset made dense says nothing
    for name in PRESETS:
        no_warning(preset=name)
        no_warning(preset=name, overrides={"model.num_experts": "0"})
    no_warning(preset="tiny", overrides={"model.num_experts": "0", "model.dense_layers": "[]",
                                         "model.router.top_k": "2"})


def test_a_dense_model_from_a_config_file_warns_on_the_command_line_as_one_line(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text("model:\n  num_experts: 0\n  router:\n    top_k: 4\n")
    assert main(["info", "--config", str(tmp_path / "c.yaml")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-train: warning: model.router.top_k=4: no effect with "
                                               "model.num_experts=0"), err


@pytest.mark.parametrize("overrides,listed", [
    ({"model.dense_layers": "[0, 1, 2, 3]"}, "model.dense_layers=[0, 1, 2, 3] lists every layer (model.num_layers=4)"),
    ({"model.num_layers": "1"}, "model.dense_layers=[0] lists every layer (model.num_layers=1)"),  # tiny's [0]
])
def test_an_moe_model_whose_dense_layers_cover_every_layer_warns_that_experts_do_nothing(overrides, listed):
    with pytest.warns(UserWarning) as caught:
        build_config("tiny", overrides=overrides)
    assert len(caught) == 1 and str(caught[0].message) == (
        f"{listed}, so the model has no MoE layer: model.num_experts=8, model.expert_hidden, "
        "model.shared_expert_hidden, model.shared_expert_gate and model.router.* have no effect; leave a layer out "
        "of model.dense_layers, or set model.num_experts=0 for a dense model")
    no_warning(preset="tiny", overrides={"model.dense_layers": "[0, 1, 2]"})  # layer 3 is an MoE layer


@pytest.mark.parametrize("override,shown,expected", [
    ("--model.dense_layers=[0x1]", "model.dense_layers[]=0x1", "an integer in decimal ASCII digits"),
    ("--model.dense_layers=[0, 1_0]", "model.dense_layers[]=1_0", "an integer in decimal ASCII digits"),
    ("--model.dense_layers=[０]", "model.dense_layers[]=０", "an integer in decimal ASCII digits"),
    ("--model.router={top_k: 0b10}", "model.router.top_k=0b10", "an integer in decimal ASCII digits"),
    ("--model.router={top_k: 2, expert_bias: -0}", "model.router.expert_bias=-0", "true or false"),
])
def test_numbers_inside_a_list_or_mapping_on_the_command_line_are_held_to_its_spelling(capsys, override, shown,
                                                                                     expected):
    """A number typed on the command line is decimal ASCII (QA 111), inside a list or mapping too: [0x1] was read as
    [1]. The same text in a YAML file keeps YAML's reading, as a scalar field's does."""
    line = error_line(capsys, ["info", override])
    assert line.startswith(f"moe-train: error: {shown}: expected {expected}") and override in line, line


def test_a_list_in_a_config_file_keeps_yamls_reading_of_its_numbers(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text("model:\n  dense_layers: [0x1]\n")
    assert resolved(capsys, ["info", "--config", str(tmp_path / "c.yaml")])["model"]["dense_layers"] == [1]
    assert resolved(capsys, ["info", "--model.dense_layers=[0, 1e0]"])["model"]["dense_layers"] == [0, 1]
