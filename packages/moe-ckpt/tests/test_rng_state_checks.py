"""check_rng_state / restore_rng_state on damaged states: a ValueError naming the key, and no generator of the
process changed (restore_rng_state used to set torch's CPU generator, then fail on numpy's state with a bare
KeyError or IndexError, leaving the process half-restored)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from moe_ckpt import capture_rng_state, check_rng_state, restore_rng_state


def _damaged(key: str) -> dict:
    state = capture_rng_state()
    if key == "torch_cpu":
        state[key] = state[key][:40]  # base64 of a state cut short
    elif key == "numpy":
        state[key] = state[key][:1]  # the kind alone
    elif key == "python":
        del state[key]
    return state


@pytest.mark.parametrize("key", ["torch_cpu", "numpy", "python"])
def test_a_damaged_state_is_refused_naming_its_key_before_any_generator_is_set(key):
    state = _damaged(key)
    with pytest.raises(ValueError, match=repr(key)):
        check_rng_state(state)
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with pytest.raises(ValueError, match=repr(key)):
        restore_rng_state(state)
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate())
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2]


def test_an_intact_state_passes_and_restores_the_draws():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    state = copy.deepcopy(capture_rng_state())
    draws = (torch.rand(3), np.random.rand(3), random.random())
    check_rng_state(state)
    restore_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]
    with pytest.raises(ValueError, match="list"):
        check_rng_state([state])
