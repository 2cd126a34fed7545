"""An AsyncCheckpointer save still in flight when the interpreter exits (no `with` block, no wait()): it used to be
lost without a word (the daemon thread killed, a step-N.tmp left). Now the exit waits for it, on every rank, saying
so on stderr, and says how it ended."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from moe_ckpt import find_latest, load_checkpoint, step_dir

SAVE_AND_EXIT = textwrap.dedent("""
    import sys, time, torch
    from moe_ckpt import AsyncCheckpointer, Box, ShardSpec, step_dir
    root, rank, world, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        group = dist.new_group(backend="gloo")
        barrier = lambda: (time.sleep(0.3), dist.barrier(group=group))
    else:
        barrier = lambda: time.sleep(0.3)  # the save is still in flight when the script ends
    piece = torch.full((2, 3), float(rank + 1))
    shard = ShardSpec("w", (2 * world, 3), piece, Box.dim0((2 * world, 3), 2 * rank, 2))
    meta = {"step": 1} if sys.argv[5] == "ok" else {"step": object()}  # not JSON: the save fails in the background
    AsyncCheckpointer().save(step_dir(root, 1), [shard], meta, rank, world, barrier)
    print("script done", flush=True)
""")


def run_ranks(tmp_path, world: int, mode: str = "ok") -> list[subprocess.CompletedProcess]:
    script = tmp_path / "save_and_exit.py"
    script.write_text(SAVE_AND_EXIT)
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), str(r), str(world), init, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_a_save_in_flight_at_exit_is_waited_for_and_committed_saying_so(tmp_path):
    (done,) = run_ranks(tmp_path, 1)
    assert done.returncode == 0 and "script done" in done.stdout, done.stderr
    root = tmp_path / "run"
    assert find_latest(root) == step_dir(root, 1), sorted(p.name for p in root.iterdir())
    assert "in flight" in done.stderr and f"{step_dir(root, 1)} committed at exit" in done.stderr, done.stderr


def test_a_save_in_flight_at_exit_commits_on_every_rank_of_a_gloo_job(tmp_path):
    ranks = run_ranks(tmp_path, 2)
    for r in ranks:
        assert r.returncode == 0 and "committed at exit" in r.stderr, r.stderr
    got = load_checkpoint(tmp_path / "run")["w"]
    assert got[:2].eq(1).all() and got[2:].eq(2).all()


def test_a_save_that_fails_at_exit_says_so_naming_the_error(tmp_path):
    """Nothing raises at exit, but the failure is printed, not dropped with the thread."""
    (done,) = run_ranks(tmp_path, 1, "metadata-not-json")
    root = tmp_path / "run"
    assert find_latest(root) is None
    assert f"save of {step_dir(root, 1)} failed and is not committed: TypeError" in done.stderr, done.stderr
    assert "object is not JSON serializable" in done.stderr, done.stderr


def test_a_save_where_no_thread_can_start_writes_its_shard_on_its_own_thread(tmp_path, monkeypatch):
    """CPython 3.12.0 and 3.12.1 refuse new threads in exit hooks (gh-113964), where the saves above finish: the shard
    writer's checksum and writeback threads could not start and the save failed ("can't create new thread at
    interpreter shutdown"). The same refusal, made here on any Python: the save writes the same bytes."""
    import threading

    import torch

    from moe_ckpt import Box, ShardSpec, save_checkpoint

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    w = torch.arange(12.0).reshape(4, 3)
    shards = [ShardSpec("w", (4, 3), w, Box.dim0((4, 3), 0, 4))]
    save_checkpoint(step_dir(tmp_path / "threads", 1), shards, {"step": 1})
    monkeypatch.setattr(threading.Thread, "start", refuse)
    save_checkpoint(step_dir(tmp_path / "none", 1), shards, {"step": 1})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "none")["w"].equal(w)
    shard = "shard-00000-of-00001.safetensors"
    got, want = (step_dir(tmp_path / run, 1) / shard for run in ("none", "threads"))
    assert got.read_bytes() == want.read_bytes()
