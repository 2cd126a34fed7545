import os
import signal

import pytest

from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig
from moe_train.trainer.runtime import LocalRuntime


def small_config(tmp_path, **train) -> Config:
    """A very small MoE for fast CPU tests, on a small data folder made by the `data_dir` fixture."""
    return Config(
        model=ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                          dense_hidden=64, dense_layers=[0], num_experts=4, expert_hidden=16,
                          shared_expert_hidden=16, router=RouterConfig(top_k=2, expert_bias=True)),
        data=DataConfig(path=str(tmp_path / "data"), seq_len=32),
        train=TrainConfig(**{"steps": 6, "micro_batch_size": 4, "grad_accum": 2, "warmup_steps": 2,
                             "eval_interval": 3, "eval_windows": 8, "log_interval": 2, "save_interval": 3,
                             "run_dir": str(tmp_path / "run"), "progress": False, **train}),
        preset="test",
    )


@pytest.fixture
def data_dir(tmp_path):
    from moe_train.data import prepare_data, stdlib_documents

    docs = list(stdlib_documents(200_000))
    return prepare_data(docs, tmp_path / "data", vocab_size=512, source="stdlib-test")


@pytest.fixture
def make_config():
    """Factory: make_config(tmp_path, **train_overrides) -> a small Config."""
    return small_config


class SignalAtStep2(LocalRuntime):
    """Sends `signum` to this process during the second optimizer step: one step is done when it lands."""

    signum = signal.SIGINT

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, lr):
        result = super().step(lr)
        self.steps += 1
        if self.steps == 2:
            os.kill(os.getpid(), self.signum)
        return result
