"""QA 150 (mutation audit, review helper 163; the code was right, this test fails on the planted bug).

Range checks of validate() that no test reached: removing them passed every config test.

min_lr_ratio > 1 would make every decaying schedule climb to a multiple of lr; an expert capacity factor in (0, 1)
(which moe_kernels accepts) would drop most routed rows every step. Both must be refused when the config is built."""

import pytest

from moe_train.config import ConfigError
from moe_train.config_io import build_config, parse_overrides


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_min_lr_ratio_outside_0_1_is_refused(value):
    with pytest.raises(ConfigError, match=rf"train.min_lr_ratio={value}: expected in \[0, 1\]"):
        build_config("tiny", None, parse_overrides([f"--train.min_lr_ratio={value}"]))


@pytest.mark.parametrize("value", ["0.5", "0.999"])
def test_an_expert_capacity_factor_between_0_and_1_is_refused(value):
    with pytest.raises(ConfigError, match=rf"parallel.expert_capacity_factor={value}: expected 0 \(dropless\) or >= 1"):
        build_config("tiny", None, parse_overrides([f"--parallel.expert_capacity_factor={value}"]))


def test_the_edges_are_accepted():
    build_config("tiny", None, parse_overrides(["--train.min_lr_ratio=1"]))
    build_config("tiny", None, parse_overrides(["--train.min_lr_ratio=0"]))
    build_config("tiny", None, parse_overrides(["--parallel.expert_capacity_factor=1"]))
    build_config("tiny", None, parse_overrides(["--parallel.expert_capacity_factor=0"]))


def test_a_negative_dense_layer_index_is_refused():
    """model.dense_layers=[-1] reads as "the last layer" to a Python user, but is_moe_layer compares indices, so it
    would name no layer and every layer would stay MoE, silently."""
    with pytest.raises(ConfigError, match=r"model.dense_layers=\[-1\]: expected indices in \[0, "):
        build_config("tiny", None, parse_overrides(["--model.dense_layers=[-1]"]))
