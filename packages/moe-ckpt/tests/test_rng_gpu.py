"""The CUDA part of capture_rng_state / restore_rng_state: one process's saved state (rank 0's metadata) is restored
onto the current device of whichever process resumes, so rank r (drawing on cuda:r) goes on with the draws it
would have made. Before moe-ckpt 0.14.0 every device's state was saved and restored device by device, which
gave rank r rank 0's untouched copy of cuda:r's generator."""

from __future__ import annotations

import json

import pytest
import torch

from moe_ckpt import capture_rng_state, restore_rng_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _draw(device: int) -> torch.Tensor:
    return torch.rand(257, device=f"cuda:{device}").cpu()


def test_the_current_devices_state_round_trips_through_json():
    torch.manual_seed(3)
    _draw(0)  # move the generator off its seed
    state = json.loads(json.dumps(capture_rng_state()))
    assert "torch_cuda_device" in state and "torch_cuda" not in state
    expect = _draw(0)
    _draw(0)
    restore_rng_state(state)
    assert torch.equal(_draw(0), expect)


def test_a_state_saved_before_0_14_restores_every_device_as_saved():
    torch.manual_seed(4)
    _draw(0)
    legacy = capture_rng_state()
    legacy["torch_cuda"] = [_b64_state(d) for d in range(torch.cuda.device_count())]
    del legacy["torch_cuda_device"]
    expect = _draw(0)
    restore_rng_state(legacy)
    assert torch.equal(_draw(0), expect)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_state_saved_on_device_0_is_restored_onto_device_1():
    """Rank 0 saves on cuda:0, rank 1 restores with cuda:1 current: cuda:1 draws what cuda:0 would have drawn."""
    torch.manual_seed(5)
    with torch.cuda.device(0):
        _draw(0)
        state = capture_rng_state()
        expect = _draw(0)
    with torch.cuda.device(1):
        restore_rng_state(state)
        assert torch.equal(_draw(1), expect)


def _b64_state(device: int) -> str:
    import base64

    return base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode("ascii")
