"""QA 138: moe-train's naming of a peer's failure (trainer/peer_failure.py, its use in trainer/loop.py), on 3 gloo
ranks of the real Trainer with RuntimeError(f"boom-{rank}") injected in model.loss at the run's second step.

Found, fixed (peer_failure.py):
- Two ranks failing at about the same step with their own errors (boom-1 on rank 1, boom-2 on rank 2): `explain`
  took every plain RuntimeError for a failed gloo collective, so rank 2, whose own error was boom-2 and which had
  reached no collective, raised "TrainingError: rank 1 of 3 failed (RuntimeError: boom-1); rank 2 stopped with it
  (its collective failed: boom-2)" (and recorded boom-2 as a consequence, in its metrics.jsonl end event too).
  Only a collective's failure is explained now: a DistError (NCCL), or a RuntimeError whose text names gloo (gloo's
  errors carry their source path, "[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer", "[.../gloo/...]
  Timed out waiting ..."). `test_two_ranks_failing_together_each_raise_their_own_error` fails before.

Held (asserted here; times observed on 2 CPU cores, collective timeout 8 s):
- rank 0 failing alone (it hosted the store then; see below): ranks 1 and 2 stop about 0.27 s after its fault, each with
  "rank 0 of 3 failed (RuntimeError: boom-0); rank N stopped with it (its collective failed: [...gloo...]
  Connection closed by peer ...)": the store read (first_cause) happens before rank 0's process exits, no hang;
- a caller-owned default group (dist.init_process_group run by the caller before Trainer()): rank 1 failing mid-step
  stops ranks 0 and 2 about 0.27 s later, naming rank 1 and boom-1 (the Trainer's own dp group, destroyed by the
  failing rank, is what the step's collectives ran on), not after the collective timeout;
- in the two-failures job rank 0 names the lowest failed rank (rank 1, boom-1) and stops about 0.27 s later.

Where the store lives: the jobs run as torchrun runs them, the rendezvous store hosted by the launcher (here the test
process, as torchrun's agent hosts it: TORCHELASTIC_USE_AGENT_STORE), so a record outlives the rank that wrote it.
When rank 0 hosts the store (a launch without torchrun, job "zero_rank0_store"), its own record goes with its process:
on an idle machine the peers read it first (about 0.27 s, above), but under load (the suite on 2 pytest-xdist workers)
rank 0 exited first and a peer raised gloo's bare "Connection closed by peer". That job asserts only what holds
either way: the peers stop promptly, and a peer that names a rank names rank 0 and its error.

Noted, not a defect (best effort, as peer_failure.py says): the test paces rank 2 0.1 s behind rank 1. Unpaced, rank 2
may read the store before rank 1's record is in it; paced 0.5 s when rank 0 hosted the store, rank 0 had already left
(about 0.27 s), so there was nothing to read. Either way the misleading message needed rank 1's record present.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moe_train.trainer.peer_failure import failed_collective

sys.path.insert(0, str(Path(__file__).parent))
import qa138_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_S = 3.0  # observed about 0.27 s; the jobs' collective timeout is 8 s
JOBS = {  # key -> Job overrides; every job on 3 ranks
    # rank 2 raises 0.1 s after rank 1 (inside its forward, before its step's first collective): rank 1's record
    # is then in the store when rank 2 fails, as it was in most unpaced probes (a race otherwise)
    "two": {"fault_ranks": (1, 2), "delays": {2: 0.1}},
    "zero": {"fault_ranks": (0,)},
    "caller": {"fault_ranks": (1,), "caller_group": True},
    "zero_rank0_store": {"fault_ranks": (0,), "agent_store": False},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{key: [rank 0's result, rank 1's, rank 2's]}, every job on one spawn of 3 ranks."""
    from moe_train.data import prepare_data, stdlib_documents

    root = tmp_path_factory.mktemp("qa138")
    data = prepare_data(list(stdlib_documents(60_000)), root / "data", vocab_size=512, source="stdlib-test")
    jobs = []
    for key, over in JOBS.items():
        (root / key).mkdir()
        jobs.append(w.Job(str(root / key / "run"), str(data), 3, **over))
    results = h.spawn_jobs(w.worker, 3, jobs, root / "out", host_stores=[job.agent_store for job in jobs])
    return {key: [results[r][job.run_dir] for r in range(3)] for key, job in zip(JOBS, jobs)}


def seconds_after_fault(results: list[dict], rank: int) -> float:
    faults = [r["fault_at"] for r in results if r["fault_at"] is not None]
    assert faults, "the fault never fired"
    return results[rank]["ended_at"] - min(faults)


def assert_names(res: dict, failed: int, stopped: int) -> None:
    assert res["error"] == "TrainingError", res.get("trace")
    assert res["message"].startswith(f"rank {failed} of 3 failed (RuntimeError: boom-{failed}); rank {stopped} "
                                     "stopped with it (its collective failed: "), res["message"]
    assert "gloo" in res["message"] and "boom" not in res["message"].split("its collective failed")[1]


def test_failed_collective_tells_gloo_failures_from_a_ranks_own_runtime_error():
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
                        "by peer [127.0.0.1]:49805. This is typically caused by a remote worker crashing.")
    assert failed_collective(gloo)
    assert not failed_collective(RuntimeError("boom-2"))
    assert not failed_collective(ValueError("gloo"))


def test_a_failed_collective_with_no_record_to_read_says_so_and_keeps_the_backends_error():
    """A rank killed outright (kill -9, the OOM killer) records nothing: before moe-train 0.27.15 the survivors
    raised gloo's bare "Connection reset by peer" (review helper 151); now a TrainingError saying what that leaves."""
    from moe_train.trainer.errors import TrainingError
    from moe_train.trainer.peer_failure import PeerFailures, explain

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                        "[127.0.0.1]:40000: Connection reset by peer")
    nobody = PeerFailures(rank=1, world_size=4)  # no process group here, so no store: nothing to read
    stopped = explain(gloo, nobody)
    assert isinstance(stopped, TrainingError) and stopped.peer_failure
    assert str(stopped).startswith("rank 1 of 4 stopped: a collective failed and no other rank's error could be read "
                                   "(a rank killed outright, e.g. by SIGKILL or the out-of-memory killer;")
    assert str(stopped).endswith("(its collective failed: " + str(gloo) + ")")
    own = RuntimeError("boom")  # this rank's own error, and one process's: left as they are
    assert explain(own, nobody) is own and explain(gloo, PeerFailures(rank=0, world_size=1)) is gloo
    # this rank's own misuse of a collective names gloo but no peer: left as it is (0.27.15 relabelled it as a peer
    # failure; review helper 157)
    misuse = RuntimeError("ProcessGroupGloo::reduce: invalid root rank: 5")
    assert failed_collective(misuse) and explain(misuse, nobody) is misuse
    timed_out = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:446] Timed out waiting 2000ms for recv")
    assert isinstance(explain(timed_out, nobody), TrainingError)


def test_two_ranks_failing_together_each_raise_their_own_error(runs):
    r0, r1, r2 = runs["two"]
    assert (r1["error"], r1["message"]) == ("RuntimeError", "boom-1"), r1.get("message")
    assert (r2["error"], r2["message"]) == ("RuntimeError", "boom-2"), r2.get("message")
    assert_names(r0, failed=1, stopped=0)
    assert seconds_after_fault(runs["two"], 0) < PROMPT_S


def test_rank_0_failing_alone_stops_the_others_promptly_naming_it(runs):
    results = runs["zero"]
    assert (results[0]["error"], results[0]["message"]) == ("RuntimeError", "boom-0")
    for rank in (1, 2):
        assert_names(results[rank], failed=0, stopped=rank)
        assert seconds_after_fault(results, rank) < PROMPT_S


def test_a_caller_owned_group_stops_the_others_promptly_naming_the_failed_rank(runs):
    results = runs["caller"]
    assert (results[1]["error"], results[1]["message"]) == ("RuntimeError", "boom-1")
    for rank in (0, 2):
        assert_names(results[rank], failed=1, stopped=rank)
        assert seconds_after_fault(results, rank) < PROMPT_S


def test_rank_0_hosting_the_store_and_failing_alone_stops_the_others_promptly(runs):
    """Best effort (see the module's docstring): rank 0's record goes with its process, so a peer names it only when
    it reads the store first; either way it stops promptly, and never names another rank or error."""
    results = runs["zero_rank0_store"]
    assert (results[0]["error"], results[0]["message"]) == ("RuntimeError", "boom-0")
    for rank in (1, 2):
        res = results[rank]
        assert res["error"] == "TrainingError", res.get("trace")
        if "no other rank's error could be read" in res["message"]:  # rank 0's record went with its process
            assert failed_collective(RuntimeError(res["message"])) and "rank 0 gone with the store" in res["message"]
        else:
            assert_names(res, failed=0, stopped=rank)
        assert seconds_after_fault(results, rank) < PROMPT_S
