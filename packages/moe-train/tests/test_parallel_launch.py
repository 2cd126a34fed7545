"""make_runtime: the CLI edge picks the runtime and validates the layout before any process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_train.presets import tiny
from moe_train.trainer.runtime import LocalRuntime
from moe_train.trainer.launch import make_runtime


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_plain_single_process_run_gets_the_local_runtime():
    assert isinstance(make_runtime(tiny(), torch.device("cpu")), LocalRuntime)


def test_parallel_layout_without_a_launcher_fails_before_any_process_group():
    cfg = tiny()
    cfg.parallel.dp = 2
    with pytest.raises(ValueError, match="parallel.dp=2 x parallel.pp=1 = 2 does not equal world_size=1"):
        make_runtime(cfg, torch.device("cpu"))
    assert not dist.is_initialized()
