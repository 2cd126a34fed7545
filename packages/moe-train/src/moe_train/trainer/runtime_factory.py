"""Pick the runtime for this process (single-process until the distributed runtime lands)."""

from __future__ import annotations

import torch

from moe_train.config import Config
from moe_train.trainer.runtime import LocalRuntime, Runtime


def make_runtime(cfg: Config, device: torch.device) -> Runtime:
    return LocalRuntime(cfg, device)
