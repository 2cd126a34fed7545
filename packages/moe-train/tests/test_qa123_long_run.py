"""QA 123: a long run stays healthy. What the training process holds and what it writes and reads per step does not
grow with the step count, and a run folder resumed again and again holds keep_last checkpoints, one record per
step and nothing else.

Measured on the real CLI by tools/long_run_hygiene.py (3,000 steps with a save every 25, three resumes, SIGINT and
SIGKILL mid-save, 2 gloo ranks: flat RSS, fds, threads and step time, every file written once). These guards run the
trainer in-process for 135 steps and compare two windows of 50 steps (30 -> 80 and 80 -> 130) that hold the same
work: 10 log records, 2 evals and 2 saves each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import test_parallel_harness as h
from qa123_probe import ProbedTrainer, growth, process_sample, two_rank_run

MARKS = (30, 80, 130)
WINDOW = dict(micro_batch_size=2, grad_accum=1, eval_interval=25, eval_windows=2, log_interval=5, save_interval=25,
              keep_last=2, threads=1)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, _prepared_data):
    """A 135-step run sampled at MARKS: {mark: process_sample()}."""
    tmp = tmp_path_factory.mktemp("qa123")
    shutil.copytree(_prepared_data, tmp / "data")
    trainer = ProbedTrainer(h.small_config(tmp, steps=135, **WINDOW), marks=MARKS)
    trainer.train()
    return trainer.samples


def test_python_objects_memory_blocks_threads_and_fds_do_not_grow_per_step(long_run):
    # one object kept per step (a record, a tensor, a hook) would add 50 in each window. Growth only: a thread or
    # garbage another test left behind may go away meanwhile.
    for a, b in zip(MARKS, MARKS[1:]):
        grown = growth(long_run, a, b)
        assert grown["objects"] <= 5 and grown["threads"] <= 0 and grown["fds"] <= 0, (a, b, grown)
    # Python's allocator also counts what the collector does not track (a dict of floats kept per step: ~6 blocks a
    # step, ~300 more here). Without one the blocks still grow by ~3-5 a step this early (allocated inside torch ops
    # called from the model's lines; cause not traced), slowing to ~0.2 a step after step 700 of a longer run.
    late = growth(long_run, *MARKS[1:])
    assert late["blocks"] <= 350, late


def test_bytes_written_and_read_per_step_do_not_grow_with_the_step_count(long_run):
    """The two windows write and read the same bytes (to within 0.5%): nothing is rewritten or re-read whole each
    log or save (metrics.jsonl appended, the checkpoints' history not re-read), which would cost O(steps^2)."""
    early, late = growth(long_run, *MARKS[:2]), growth(long_run, *MARKS[1:])
    for key in ("wchar", "rchar"):
        assert early[key] > 0
        assert abs(late[key] - early[key]) <= 0.005 * early[key], (key, early[key], late[key])


@pytest.mark.filterwarnings("ignore")  # recorded by pytest, each resume's warning would count as objects held
def test_resumes_keep_keep_last_checkpoints_one_record_per_step_and_no_leftovers(tmp_path, data_dir):
    """Four runs into one folder, the second after what a SIGKILL mid-save leaves (a step-N.tmp with a partial shard,
    a retention's step-N.tmp-delete-*, a `latest` temp file): each ends with keep_last checkpoints and no temporary
    name, every step logged once, and the process holding no more objects, threads or fds after the fourth than after
    the third (the first runs of a path fill caches once)."""
    after = []
    for i, steps in enumerate((20, 30, 40, 50)):
        ckpts = tmp_path / "run" / "checkpoints"
        if i == 1:
            (ckpts / "step-00000025.tmp").mkdir()
            (ckpts / "step-00000025.tmp" / "shard-00000-of-00001.safetensors").write_bytes(b"\0" * 4096)
            (ckpts / "step-00000010.tmp-delete-0123abcd").mkdir()
            (ckpts / f".latest.tmp-{'0' * 32}").write_text("step-00000025\n")
        ProbedTrainer(h.small_config(tmp_path, steps=steps, **{**WINDOW, "save_interval": 5}), marks=()).train()
        after.append(process_sample())
        check_run_folder(tmp_path / "run", steps, runs=i + 1)
    third, fourth = after[2:]
    assert fourth["objects"] - third["objects"] <= 5, (third, fourth)
    assert fourth["threads"] <= third["threads"] and fourth["fds"] <= third["fds"], (third, fourth)


def check_run_folder(run: Path, steps: int, runs: int) -> None:
    """The last two checkpoints (every 5 steps), `latest`, metrics.jsonl and the lock file, nothing else; each step
    record once, a start and an end event per run. (A function: the records read here are not held at the next
    process_sample.)"""
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    kept = [f"checkpoints/step-{s:08d}/{name}" for s in (steps - 5, steps)
            for name in ("index.json", "metadata.json", "shard-00000-of-00001.safetensors")]
    assert files == sorted([".lock", "checkpoints/latest", "metrics.jsonl", *kept]), files
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "event" not in r and "loss" in r] == list(range(5, steps + 1, 5))
    assert [r["event"] for r in records if "event" in r] == ["start", "end"] * runs


def test_two_gloo_ranks_hold_no_more_objects_blocks_threads_or_fds_per_step_and_log_each_step_once(tmp_path, data_dir):
    """Per rank on 2 gloo ranks (a process group per layout, collectives each step, the background barrier of a
    save): the same windows hold no more objects, memory blocks, threads or fds; the folder as on one rank."""
    (tmp_path / "out").mkdir()
    h.start_ranks(h.run_guarded, args=(two_rank_run, str(tmp_path / "out"), h.free_port(), str(tmp_path), 135, MARKS),
                  nprocs=2)
    for rank, result in enumerate(h.load_results(tmp_path / "out", 2)):
        for a, b in zip(MARKS, MARKS[1:]):
            grown = growth(result["samples"], a, b)
            assert grown["objects"] <= 5 and grown["threads"] <= 0 and grown["fds"] <= 0, (rank, a, b, grown)
        late = growth(result["samples"], *MARKS[1:])
        assert late["blocks"] <= 350, (rank, late)  # as on one rank
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["latest", "step-00000125", "step-00000135"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "event" not in r and "loss" in r] == [*range(5, 135, 5), 135]
