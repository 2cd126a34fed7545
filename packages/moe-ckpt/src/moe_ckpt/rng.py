"""RNG states as JSON: torch (CPU and this process's CUDA device) as base64, numpy and Python as lists.

One process saves the state (rank 0 writes the checkpoint metadata) and every process restores it, so the
CUDA state kept is the current device's, the one this process draws on, and it is restored onto each
restoring process's current device. All devices' states, as before, would give rank r (drawing on cuda:r)
rank 0's untouched copy of cuda:r's generator: the draws of step 1 again."""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state() -> dict:
    """Every RNG this process seeds, as a JSON-serialisable dict (for the checkpoint metadata)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch_cpu": _b64(torch.get_rng_state()),
        "numpy": [np_state[0], np_state[1].tolist(), *map(_plain, np_state[2:])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda_device"] = _b64(torch.cuda.get_rng_state())  # the current device's
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state: the saved CUDA state goes to the current device, if saved and CUDA is
    present. A state written before moe-ckpt 0.14.0 (every device's, "torch_cuda") is restored device by
    device, as it was saved."""
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if not torch.cuda.is_available():
        return
    if "torch_cuda_device" in state:
        torch.cuda.set_rng_state(_unb64(state["torch_cuda_device"]))
    elif "torch_cuda" in state:
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["torch_cuda"]])


def _plain(x):
    return x.item() if hasattr(x, "item") else x
