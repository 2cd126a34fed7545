"""FlatParams, GradientSync and DistributedAdamW are freed once the caller drops them (2 gloo ranks, one spawn).

Their post-accumulate-grad hooks live in the parameters' C++ autograd state, which Python's garbage collector
cannot traverse: a hook holding its owner strongly made an uncollectable cycle, so the flat buffers and the
process group stayed alive for the life of the process, and gloo's worker threads with them. The same held for
the world group once torch imported torch.distributed.nn after init_process_group (its default group= arguments). A gloo thread still
running at interpreter exit aborted the rank about one run in ten ("terminate called without an active
exception": it takes the GIL to release a finished collective's tensors while Python finalizes); CI failed on it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("lifetime_worker")
parallel_spawn = importlib.import_module("parallel_spawn")

WORLD = 2
DEADLINE_S = 120

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return parallel_spawn.run_ranks(worker.run_rank, WORLD, tmp_path_factory.mktemp("lifetime"), DEADLINE_S)


def test_dropped_flat_params_sync_and_optimizer_are_freed_without_remove_hooks(ranks):
    for r, res in enumerate(ranks):
        assert res["alive"] == [], f"rank {r}: still alive after del + gc.collect(): {res['alive']}"


def test_the_hooks_left_on_the_model_do_nothing_once_their_owners_are_gone(ranks):
    for res in ranks:  # autograd's own gradient stays on the parameter; no error from a hook
        assert all(res["grads_after"].values()), res["grads_after"]


def test_destroying_the_process_group_joins_its_gloo_threads(ranks):
    """Also after torch imported torch.distributed.nn lazily, after init_process_group (moe_parallel imports it
    first: its collectives' default group= would otherwise hold the world group)."""
    for r, res in enumerate(ranks):
        assert res["dynamo_imported_after_init"], res  # else this run did not exercise the lazy import
        assert res["threads_with_group"] > res["threads_before_init"], res  # the check can see gloo's threads
        assert res["threads_after_destroy"] == res["threads_before_init"], (
            f"rank {r}: {res['threads_after_destroy']} threads after destroy_process_group + gc.collect(), "
            f"{res['threads_before_init']} before init_process_group: the group is still referenced")
