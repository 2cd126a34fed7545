"""The process group apply_fsdp shards over dies with destroy_process_group (2 gloo ranks, one spawn, ~15 s on
2 cores).

torch's DTensor caches (sharding propagation, redistribute planners, mesh topology) keep every DeviceMesh an op
saw until the process exits, and the mesh apply_fsdp built held its group strongly, in a dict of pybind objects
that the garbage collector does not track (no Python referrer shows up): after destroy_process_group the group,
and its gloo threads, lived into interpreter exit, where one releasing a collective's tensors can abort the rank
(pytorch#190489). Every FSDP2-baseline rank hit it: the ranks of test_activation_checkpointing (moe-train) and
test_qa44 exited with a live gloo group.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
worker = importlib.import_module("qa65_worker")
parallel_spawn = importlib.import_module("parallel_spawn")

WORLD = 2
DEADLINE_S = 120

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names in /proc (Linux)")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return parallel_spawn.run_ranks(worker.run_rank, WORLD, tmp_path_factory.mktemp("qa65"), DEADLINE_S)


def test_fsdp_trains_over_the_group_it_was_given(ranks):
    for r, res in enumerate(ranks):
        assert len(res["losses"]) == 2 and all(math.isfinite(v) for v in res["losses"]), f"rank {r}: {res['losses']}"


def test_destroy_process_group_frees_the_group_fsdp_trained_over_and_joins_its_gloo_threads(ranks):
    for r, res in enumerate(ranks):
        assert res["threads_with_groups"], res  # else the check could not see gloo's threads
        assert res["alive"] == [], f"rank {r}: alive after destroy_process_group + gc.collect(): {res['alive']}"
        assert res["threads_after_destroy"] == [], f"rank {r}: gloo threads left: {res['threads_after_destroy']}"
