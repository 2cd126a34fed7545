import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from moe_train.trainer.runtime import LocalRuntime

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_harness import small_config  # noqa: E402,F401 - one definition: spawned workers import it there


@pytest.fixture(scope="session")
def _prepared_data(tmp_path_factory):
    """The data folder `data_dir` copies: prepared once per session (a BPE trained on 200K characters of the
    standard library, ~1 s), since prepare_data gives the same bytes every time."""
    from moe_train.data import prepare_data, stdlib_documents

    docs = list(stdlib_documents(200_000))
    return prepare_data(docs, tmp_path_factory.mktemp("prepared") / "data", vocab_size=512, source="stdlib-test")


@pytest.fixture
def data_dir(tmp_path, _prepared_data):
    """A prepared data folder of this test's own (tmp_path / "data"): a test may change or damage it."""
    return Path(shutil.copytree(_prepared_data, tmp_path / "data"))


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


def pytest_configure(config):
    """The marks these tests use, registered here too: the package's tests run alone (an sdist, a
    copy in another repository, `--strict-markers`) without the monorepo's pytest config."""
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: multi-process or long tests")
