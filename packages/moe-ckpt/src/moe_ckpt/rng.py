"""RNG states as JSON: torch (CPU and each CUDA device) as base64, numpy and Python as lists."""

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
        state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state; CUDA states are restored only if saved and CUDA is present."""
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["torch_cuda"]])


def _plain(x):
    return x.item() if hasattr(x, "item") else x
