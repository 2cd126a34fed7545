import sys
from pathlib import Path

# Helper modules beside the tests (ckpt_cases, the gloo worker) import by plain name,
# including from subprocesses started by torch.multiprocessing.spawn.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    """The marks these tests use, registered here too: the package's tests run alone (an sdist, a
    copy in another repository, `--strict-markers`) without the monorepo's pytest config."""
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: multi-process or long tests")
