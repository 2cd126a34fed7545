"""QA 64: a checkpoint step that fails on every rank lets the caller's process group go as soon as the caller drops
the error (2 gloo ranks, one spawn).

fail_together, save_checkpoint and AsyncCheckpointer.wait raised an error they kept in a local variable (or in a list
of them), and that frame is on the error's traceback: error -> traceback -> frame -> error, a cycle holding what the
frame holds (the all-reduce or barrier closing over the caller's group, the checkpointer) until the next cyclic
garbage collection. A caller that caught the error, destroyed the group and exited could reach interpreter exit with
the gloo group alive, where a gloo worker thread aborts the process (SIGABRT, pytorch#190489). The good cases are the
control: a destroyed group held by nothing else is freed at once, so what the failing cases check is measured right.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from ckpt_qa64_worker import BAD, WORLD, run_rank

pytestmark = pytest.mark.slow
# what each rank raises: the rank at fault its own error, the other a CheckpointError naming it
RAISED = {
    "fail_together_failed": {BAD: "OSError: shard file damaged",
                             1 - BAD: "PeerCheckpointError: rank 0: checkpoint load failed on rank 1 of 2"},
    "save_failed": {0: "TypeError: metadata is not JSON-serialisable", 1: "CheckpointError: "},
    "async_save_failed": {BAD: "ValueError: rank 1: piece 'w[2:4]' is listed twice", 1 - BAD: "CheckpointError: "},
    "async_snapshot_failed": {BAD: "NotImplementedError: ", 1 - BAD: "CheckpointError: "},
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("qa64")
    mp.spawn(run_rank, args=(str(root),), nprocs=WORLD, join=True)
    results = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


def test_workers_import_the_code_under_test(ranks):
    import moe_ckpt

    assert {r["moe_ckpt_file"] for r in ranks} == {moe_ckpt.__file__}


def _check_freed(ranks: list[dict], name: str) -> None:
    for rank, res in enumerate(ranks):
        case = res[name]
        assert case["group_freed"] and case["holder_freed"], (
            f"rank {rank}, {name}: after the error was dropped and the group destroyed, the group is "
            f"{'freed' if case['group_freed'] else 'alive'} and what held it "
            f"{'freed' if case['holder_freed'] else 'alive'} without the garbage collector "
            f"({'freed by gc.collect(): a reference cycle' if case['freed_by_gc'] else 'alive after gc.collect() too'})"
            f"; the call ended with {case['outcome']}")


@pytest.mark.parametrize("name", ["fail_together_good", "save_good", "async_save_good"])
def test_a_good_step_leaves_nothing_holding_the_destroyed_group(ranks, name):
    assert [res[name]["outcome"] for res in ranks] == ["ok"] * WORLD
    _check_freed(ranks, name)


@pytest.mark.parametrize("name", sorted(RAISED))
def test_a_failed_step_frees_the_group_once_the_error_is_dropped_without_the_garbage_collector(ranks, name):
    for rank, res in enumerate(ranks):
        assert res[name]["outcome"].startswith(RAISED[name][rank]), (rank, res[name]["outcome"])
    _check_freed(ranks, name)
