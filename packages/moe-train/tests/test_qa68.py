"""QA of the trainer's rank-local decisions under data parallelism: what one rank alone judges (rank 0's run
folder and metrics.jsonl, the checkpoint each rank finds to resume from) stops every rank together, with the
cause, instead of one rank raising while the others wait in the next collective (gloo: "Connection closed by
peer"; NCCL: up to parallel.collective_timeout_s)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import qa68_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from test_parallel_harness import small_config  # noqa: E402

from moe_train.trainer.loop import Trainer  # noqa: E402


def _checkpoints_at_2_and_4(root: Path, data_dir: Path) -> None:
    """root/run: a one-process run's checkpoints at steps 2 and 4; root/stale: the same folder without step 4."""
    threads = torch.get_num_threads()
    cfg = small_config(root, steps=4, save_interval=2, eval_interval=0, device="cpu", threads=1)
    cfg.data.path = str(data_dir)
    try:
        Trainer(cfg).train()
    finally:
        torch.set_num_threads(threads)
    shutil.copytree(root / "run", root / "stale")
    shutil.rmtree(root / "stale" / "checkpoints" / "step-00000004")


def test_a_start_one_rank_refuses_stops_every_rank_with_the_cause(tmp_path, data_dir):
    root = tmp_path / "ranks"
    root.mkdir()
    (root / "a_file").write_text("not a folder")
    _checkpoints_at_2_and_4(root, data_dir)
    h.start_ranks(h.run_guarded, args=(w.start_dp2, str(root), [h.free_port() for _ in range(3)], str(root),
                                       str(data_dir)), nprocs=2)
    results = h.load_results(root, 2)

    data = [res["data_missing_on_rank1"] for res in results]
    assert data[1]["type"] in ("DataError", "FileNotFoundError") and "not_copied_to_this_host" in data[1]["message"], data
    assert data[0]["type"] == "PeerCheckpointError" and "opening data.path=" in data[0]["message"], data[0]
    assert "failed on rank 1 of 2" in data[0]["message"], data[0]
    assert all(res["seconds"] < 20 for res in data), data

    lock = [res["run_dir_under_a_file"] for res in results]
    assert lock[0]["type"] == "ConfigError" and "a part of the path is a file" in lock[0]["message"], lock[0]
    assert lock[1]["type"] == "RunFolderBusyError" and "rank 0 could not lock it" in lock[1]["message"], lock[1]
    assert all(res["seconds"] < 20 for res in lock), lock

    stale = [res["stale_view"] for res in results]
    for rank, res in enumerate(stale):
        assert res["type"] == "ConfigError", f"rank {rank} stopped with {res['type']}: {res['message']}"
        assert "different checkpoints to resume from" in res["message"], res
        assert all(res["seconds"] < 20 for res in stale), stale
    assert "step-00000004" in stale[0]["message"] and "step-00000002" in stale[1]["message"]
    # neither rank trained: rank 0's log got the start event's refusal, no step record past the checkpoint
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if "event" not in r) == 4


def test_rank_0s_failed_metrics_write_stops_every_rank_with_the_cause(tmp_path, data_dir):
    root = tmp_path / "ranks"
    root.mkdir()
    h.start_ranks(h.run_guarded, args=(w.metrics_write_fails_on_rank0, str(root), h.free_port(), str(root),
                                       str(data_dir)), nprocs=2)
    results = h.load_results(root, 2)
    assert results[0]["type"] == "OSError" and "No space left on device" in results[0]["message"], results[0]
    assert results[1]["type"] == "TrainingError", results[1]
    assert "rank 0 could not write" in results[1]["message"] and "metrics.jsonl" in results[1]["message"], results[1]
    assert all(res["seconds"] < 20 for res in results), results
    events = [r for r in map(json.loads, (root / "run" / "metrics.jsonl").read_text().splitlines()) if "event" in r]
    assert events[-1]["status"] == "failed" and events[-1]["error"].startswith("OSError: "), events[-1]
