"""RNG states as JSON: torch (CPU and this process's CUDA device) as base64, numpy and Python as lists.

One process saves the state (rank 0 writes the checkpoint metadata) and every process restores it, so the
CUDA state kept is the current device's, the one this process draws on, and it is restored onto each
restoring process's current device. All devices' states, as before, would give rank r (drawing on cuda:r)
rank 0's untouched copy of cuda:r's generator: the draws of step 1 again."""

from __future__ import annotations

import base64
import binascii
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


def check_rng_state(state: object) -> None:
    """Raise ValueError naming the key when `state` is not what capture_rng_state writes (a key missing, a generator
    state of the wrong size or type): each state is set on a fresh generator, so no generator of this process
    changes. restore_rng_state checks the same before it sets any."""
    _decoded(state)


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state: the saved CUDA state goes to the current device, if saved and CUDA is
    present. A state written before moe-ckpt 0.14.0 (every device's, "torch_cuda") is restored device by
    device, as it was saved. A damaged state (check_rng_state) raises ValueError before any generator is set."""
    cpu, np_state, py_state, cuda_device, cuda_all = _decoded(state)
    torch.set_rng_state(cpu)
    np.random.set_state(np_state)
    random.setstate(py_state)
    if not torch.cuda.is_available():
        return
    if cuda_device is not None:
        torch.cuda.set_rng_state(cuda_device)
    elif cuda_all is not None:
        torch.cuda.set_rng_state_all(cuda_all)


_BAD_STATE = (TypeError, ValueError, RuntimeError, OverflowError, IndexError, KeyError, binascii.Error)


def _decoded(state: object) -> tuple:
    """(torch CPU state, numpy state, Python state, the CUDA device's state or None, every device's or None) of a
    capture_rng_state dict, each checked on a fresh generator; ValueError naming the key that is wrong."""
    expected = "expected the dict capture_rng_state writes (torch_cpu, numpy, python)"
    if not isinstance(state, dict):
        raise ValueError(f"rng state is a {type(state).__name__}; {expected}")
    missing = [k for k in ("torch_cpu", "numpy", "python") if k not in state]
    if missing:
        raise ValueError(f"rng state has no {', '.join(map(repr, missing))}; {expected}")
    key = "torch_cpu"
    try:
        cpu = _unb64(state[key])
        torch.Generator().set_state(cpu)
        key = "numpy"
        kind, keys, *rest = state[key]
        np_state = (kind, np.asarray(keys, dtype=np.uint32), *rest)
        np.random.RandomState().set_state(np_state)
        key = "python"
        version, internal, gauss = state[key]
        py_state = (version, tuple(internal), gauss)
        random.Random().setstate(py_state)
        key = "torch_cuda_device"
        cuda_device = _unb64(state[key]) if key in state else None
        key = "torch_cuda"
        cuda_all = [_unb64(s) for s in state[key]] if key in state else None
    except _BAD_STATE as e:
        raise ValueError(f"rng state {key!r} is not a generator state capture_rng_state writes "
                         f"({type(e).__name__}: {e})") from None
    return cpu, np_state, py_state, cuda_device, cuda_all


def _plain(x):
    return x.item() if hasattr(x, "item") else x
