"""QA 76: a long run as a user leaves it running. Resources stay flat over the steps (with evals, async
checkpoint saves and the progress bar), retention keeps the run folder bounded, metrics.jsonl holds each step
once across a Ctrl-C and a resume, and a run is bitwise reproducible: the same config twice, and 2N steps
straight against N, Ctrl-C, resume (grad_accum 2, evals, the expert-bias update, the sampler past an epoch),
on one process and on two gloo ranks (dp=2).

The long measurement was made by hand (1,000 steps on one process, 400 on two ranks: RSS within 1 MB after the
first sample, live tensors, gc-tracked objects, fds and threads constant); the check here is its short form.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import qa76_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from test_parallel_harness import small_config  # noqa: E402

from moe_ckpt import list_checkpoints  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402

N = 20  # the stop: its checkpoint is at step N; a run is 2N steps
WINDOWS_PER_STEP = 24  # micro_batch_size 12 x grad_accum 2


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """A data folder of 13,368 training tokens: 417 windows of 33, ~17 steps an epoch, so the stop at step N is in
    the sampler's second epoch."""
    from moe_train.data import prepare_data, stdlib_documents

    out = tmp_path_factory.mktemp("qa76") / "data"
    return prepare_data(list(stdlib_documents(15_000)), out, vocab_size=512, source="qa76", eval_fraction=0.25)


def _config(root: Path, name: str, data: Path, **train):
    cfg = small_config(root, **{"steps": 2 * N, "micro_batch_size": 12, "grad_accum": 2, "eval_interval": 5,
                                "log_interval": 1, "save_interval": 5, "keep_last": 2, "async_save": True, **train})
    cfg.data.path = str(data)
    cfg.train.run_dir = str(root / name)
    return cfg


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _trained(records: list[dict]) -> tuple[list[tuple], list[tuple]]:
    """What a run computed, as its step and eval records say: (step, loss, aux_loss, lr, grad_norm, router) and
    (step, eval_loss); timing fields left out."""
    steps = [(r["step"], r["loss"], r["aux_loss"], r["lr"], r["grad_norm"], r["router"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    return steps, evals


def _checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard file, as {file/name: tensor}."""
    return {f"{shard.name}/{name}": t for shard in sorted(checkpoint.glob("*.safetensors"))
            for name, t in load_file(shard).items()}


def _assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"


def _leftovers(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if ".tmp" in p.name)


def test_a_long_run_keeps_its_tensors_fds_threads_and_memory_flat(tmp_path, data_dir, capsys):
    """45 steps, a record each step, an eval every 3, an async save every 2 (keep_last 2) and the progress bar,
    sampled at steps 15, 30 and 45 with no save in flight. By hand over 1,000 steps (save every 5, eval every 10):
    RSS 719.3 -> 719.8 MB, 130 tensors (244 with async save: its reused snapshot buffers), 331,795 gc objects,
    8 fds, 2 Python / 4 OS threads, all constant after the first sample. A leak of one tensor or one object a
    step (a list of records, router statistics) grows these by 15 between two samples."""
    cfg = small_config(tmp_path, steps=45, eval_interval=3, log_interval=1, save_interval=2, keep_last=2,
                       async_save=True, progress=True)
    cfg.data.path = str(data_dir)
    samples: list[dict] = []
    trainer = Trainer(cfg)
    w.probe_every(trainer, 15, samples)
    trainer.train()
    capsys.readouterr()
    assert [s["step"] for s in samples] == [15, 30, 45]
    first, middle, last = samples
    for key in ("fds", "threads", "os_threads"):
        assert middle[key] == last[key], (key, samples)
    assert abs(last["tensors"] - middle["tensors"]) <= 2, samples  # +-1 between samples by hand
    assert abs(last["gc_objects"] - middle["gc_objects"]) <= 10, samples  # +-2 by hand
    assert last["rss_kib"] - middle["rss_kib"] < 16 * 1024, samples  # +0.5 MB over 900 steps by hand
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000044", "step-00000045"]


def test_straight_and_stopped_then_resumed_runs_are_bitwise_identical_and_log_each_step_once(tmp_path, small_data):
    """One process: 2N steps twice (same config and seed), and 2N steps stopped by Ctrl-C during step N+3 (its
    checkpoint at N, steps N+1 and N+2 logged), then resumed by a new Trainer."""
    assert N * WINDOWS_PER_STEP > 417  # the resume point is in the sampler's second epoch
    runs = {}
    for name in ("straight", "again"):
        Trainer(_config(tmp_path, name, small_data)).train()
        runs[name] = _records(tmp_path / name)
    # keep_last=1: the one checkpoint kept is the one the resume needs
    trainer = Trainer(_config(tmp_path, "split", small_data, keep_last=1))
    w.ctrl_c_in_step(trainer, N + 3)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    del trainer
    stopped = _records(tmp_path / "split")
    assert [r["step"] for r in stopped if "loss" in r][-1] == N + 2
    assert [p.name for p in list_checkpoints(tmp_path / "split" / "checkpoints")] == [f"step-{N:08d}"]
    assert _leftovers(tmp_path / "split") == []
    summary = Trainer(_config(tmp_path, "split", small_data, keep_last=1)).train()
    assert summary["step"] == 2 * N
    runs["split"] = records = _records(tmp_path / "split")

    # metrics.jsonl: each step once, in order, across the stop; the interrupted run's records past N replaced
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 2 * N + 1))
    assert [r["step"] for r in records if "eval_loss" in r] == list(range(0, 2 * N + 1, 5))
    assert [r.get("resumed_from_step") for r in records if r.get("event") == "start"] == [None, N]
    assert [r["status"] for r in records if r.get("event") == "end"] == ["interrupted", "completed"]
    # a step record does not grow with the steps (nothing accumulates in it): ~590 bytes here
    lines = [line for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert max(len(line) for line in lines) < 1024 and len(lines[-1]) <= len(lines[0]) + 64

    # bitwise: losses, lr, grad norms, router statistics, eval losses, and every saved tensor (weights, AdamW
    # state, step counts, the expert bias) of the last checkpoint
    want = _trained(runs["straight"])
    assert _trained(runs["again"]) == want
    assert _trained(runs["split"]) == want
    last = {name: tmp_path / name / "checkpoints" / f"step-{2 * N:08d}" for name in runs}
    assert any(".expert_bias[" in name for name in _checkpoint_tensors(last["straight"]))
    for name in ("again", "split"):
        _assert_bitwise_equal(_checkpoint_tensors(last[name]), _checkpoint_tensors(last["straight"]))

    # retention: keep_last=2 (1 for the split run) of 8 saves, the newest named by `latest`, nothing half-written
    for name in runs:
        root = tmp_path / name / "checkpoints"
        kept = [f"step-{2 * N:08d}"] if name == "split" else [f"step-{2 * N - 5:08d}", f"step-{2 * N:08d}"]
        assert [p.name for p in list_checkpoints(root)] == kept
        assert (root / "latest").read_text().strip() == last[name].name
        assert _leftovers(tmp_path / name) == []


def test_two_ranks_straight_and_stopped_then_resumed_are_bitwise_identical_with_flat_resources(tmp_path, small_data):
    """dp=2 (gloo): 2n steps twice, and stopped by Ctrl-C during step n+3 then resumed; each rank's resources
    sampled in the first run. By hand over 400 steps (async save every 4, eval every 5): rank 0 201 tensors,
    51 fds, 21 OS threads, rank 1 125 / 39 / 20, constant; RSS within 1 MB."""
    n = 8
    out = tmp_path / "ranks"
    out.mkdir()
    ports = [h.free_port() for _ in range(4)]
    h.start_ranks(h.run_guarded, args=(w.straight_and_split, str(out), ports, str(tmp_path), str(small_data), n, 5),
                  nprocs=2)
    results = h.load_results(out, 2)
    for r, result in enumerate(results):
        assert "error" not in result, f"rank {r}: {result.get('error')}"
        assert "SIGINT" in result["stopped"], result["stopped"]
        samples = result["samples"]
        assert [s["step"] for s in samples] == [5, 10, 15]
        for key in ("tensors", "fds", "threads", "os_threads"):
            assert samples[1][key] == samples[2][key], (r, key, samples)
        assert abs(samples[2]["gc_objects"] - samples[1]["gc_objects"]) <= 10, (r, samples)
        # each of the four Trainers of the process leaves no tensor, fd or thread behind (its groups released)
        after = result["after"]
        assert [a["tensors"] for a in after] == [0] * 4, after
        assert len({(a["fds"], a["threads"], a["os_threads"]) for a in after}) == 1, after

    records = _records(tmp_path / "split")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 2 * n + 1))
    assert [r.get("resumed_from_step") for r in records if r.get("event") == "start"] == [None, n]
    want = _trained(_records(tmp_path / "straight"))
    assert _trained(_records(tmp_path / "again")) == want
    assert _trained(records) == want
    last = {name: tmp_path / name / "checkpoints" / f"step-{2 * n:08d}" for name in ("straight", "again", "split")}
    assert len(list(last["straight"].glob("*.safetensors"))) == 2  # one shard file per rank
    for name in ("again", "split"):
        _assert_bitwise_equal(_checkpoint_tensors(last[name]), _checkpoint_tensors(last["straight"]))
        assert [p.name for p in list_checkpoints(tmp_path / name / "checkpoints")] == [f"step-{n:08d}",
                                                                                      f"step-{2 * n:08d}"]
        assert _leftovers(tmp_path / name) == []
