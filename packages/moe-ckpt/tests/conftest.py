import sys
from pathlib import Path

import pytest

# Helper modules beside the tests (ckpt_cases, the gloo worker) import by plain name,
# including from subprocesses started by torch.multiprocessing.spawn.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    """The marks these tests use, registered here too: the package's tests run alone (an sdist, a
    copy in another repository, `--strict-markers`) without the monorepo's pytest config."""
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: multi-process or long tests")


@pytest.fixture
def ck2(tmp_path):
    """A checkpoint written by 2 simulated ranks (ckpt_cases.make_state, step 3)."""
    from ckpt_cases import make_state, run_ranks, shards_for

    from moe_ckpt import save_checkpoint

    state = make_state()
    run_ranks(2, lambda r, bar: save_checkpoint(tmp_path / "ck", shards_for(state, r, 2), {"step": 3}, r, 2, bar))
    return tmp_path / "ck"

