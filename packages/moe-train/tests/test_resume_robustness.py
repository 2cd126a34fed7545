"""How a run ends and resumes: Ctrl-C during an async save, a crash between logging and saving, a training
error, the collective timeout of the async writer's barrier, and what a one-process checkpoint stores."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from moe_ckpt import find_latest, inspect_checkpoint, step_dir
from moe_train.trainer.loop import Trainer
from moe_train.trainer.runtime import LocalRuntime

sys.path.insert(0, str(Path(__file__).parent))
import robustness_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class CtrlCDuringSave(LocalRuntime):
    """A real Ctrl-C (SIGINT to this process), sent by the async writer's first barrier, which then takes
    half a second: the loop is interrupted while the save is still being written."""

    sent = False

    def barrier(self) -> None:
        if threading.current_thread() is not threading.main_thread() and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)


def test_ctrl_c_during_an_async_save_lets_it_commit_and_the_run_resumes(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=4, save_interval=2, async_save=True, eval_interval=0, log_interval=1)
    cfg.data.path = str(data_dir)
    trainer = Trainer(cfg, CtrlCDuringSave(cfg, torch.device("cpu")))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    root = tmp_path / "run" / "checkpoints"
    assert trainer.runtime.sent and not trainer.async_saver.busy
    assert find_latest(root) == step_dir(root, 2), "the save in flight must be committed when train() returns"
    assert not [p.name for p in root.iterdir() if ".tmp" in p.name]
    end = read_metrics(tmp_path / "run")[-1]
    assert end["event"] == "end" and end["status"] == "interrupted" and end["error"].startswith("KeyboardInterrupt")
    assert Trainer(cfg).train()["step"] == 4


class SigintInAFinalizer:
    """Sends SIGINT from inside a finalizer the garbage collector runs: CPython drops the KeyboardInterrupt
    raised there ("Exception ignored in ..."), the way a real Ctrl-C is lost when it lands in one."""

    def __init__(self) -> None:
        self.cycle = self  # only the cyclic collector frees it

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        start = time.perf_counter()
        while time.perf_counter() - start < 0.05:  # bytecode for the handler to run in
            pass


class CtrlCInAFinalizer(LocalRuntime):
    dropped = False

    def step(self, lr):
        result = super().step(lr)
        if not self.dropped:
            self.dropped = True
            SigintInAFinalizer()
            gc.collect()
        return result


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_dropped_inside_a_finalizer_still_stops_the_run_at_the_next_step(tmp_path, data_dir, make_config):
    """The cause of this file's earlier flaky Ctrl-C test: in a long test session the garbage collector sometimes
    ran finalizers exactly when the signal arrived, and the run trained on to the end."""
    cfg = make_config(tmp_path, steps=4, save_interval=0, eval_interval=0, log_interval=1)
    cfg.data.path = str(data_dir)
    trainer = Trainer(cfg, CtrlCInAFinalizer(cfg, torch.device("cpu")))
    with pytest.raises(KeyboardInterrupt, match="raised again at a step boundary"):
        trainer.train()
    assert trainer.runtime.dropped and trainer.step == 1
    end = read_metrics(tmp_path / "run")[-1]
    assert end["event"] == "end" and end["status"] == "interrupted" and end["step"] == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "train() must restore the handler"


def test_a_sigint_handler_of_the_callers_own_is_left_alone(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=2, save_interval=0, eval_interval=0, log_interval=1)
    cfg.data.path = str(data_dir)
    seen = []

    class SeesItsHandler(LocalRuntime):
        def step(self, lr):
            seen.append(signal.getsignal(signal.SIGINT))
            return super().step(lr)

    def mine(signum, frame):
        raise RuntimeError("the caller's handler")

    previous = signal.signal(signal.SIGINT, mine)
    try:
        Trainer(cfg, SeesItsHandler(cfg, torch.device("cpu"))).train()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [mine, mine]


def test_resume_after_a_crash_keeps_one_record_per_step(tmp_path, data_dir, make_config):
    """The crashed run logged steps 4..6 (and died mid-line) but its step-6 checkpoint never committed:
    the resumed run starts from step 3 and its records replace those, instead of repeating them."""
    cfg = make_config(tmp_path, steps=6, save_interval=3, eval_interval=3, log_interval=1)
    cfg.data.path = str(data_dir)
    run = tmp_path / "run"
    Trainer(cfg).train()
    first = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 4.2')  # killed mid-write
    Trainer(cfg).train()
    records = read_metrics(run)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 3, 6]
    assert {r["step"]: r["loss"] for r in records if "loss" in r} == first  # resume is bit-identical
    starts = [r["resumed_from_step"] for r in records if r.get("event") == "start"]
    assert starts == [None, 3] and [r["step"] for r in records if r.get("event") == "end"] == [6, 6]


def test_a_one_process_checkpoint_stores_each_weight_once(tmp_path, data_dir, make_config):
    """LocalRuntime's fp32 master is the parameter: saved once, as the weight, and restored from it."""
    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)
    cfg.data.path = str(data_dir)
    trainer = Trainer(cfg)
    trainer.train()
    info = inspect_checkpoint(tmp_path / "run" / "checkpoints")
    params = dict(trainer.model.named_parameters())
    assert not [n for n in info["tensors"] if n.endswith(".master")]
    assert set(params) | {f"optim.{n}.exp_avg" for n in params} | {f"optim.{n}.exp_avg_sq" for n in params} \
        <= set(info["tensors"])
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    assert info["total_bytes"] < 3.1 * param_bytes  # weight + two moments (+ router biases, step): not 4x
    cfg.train.steps = 3
    resumed = Trainer(cfg)
    resumed.restore(resumed.resume_point())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, params[name]), name


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    root = tmp_path_factory.mktemp("two_ranks")
    data = prepare_data(list(stdlib_documents(100_000)), root / "data", vocab_size=512, source="stdlib-test")
    ports = [h.free_port() for _ in range(3)]
    h.start_ranks(h.run_guarded, args=(w.worker, str(root), ports, str(root), str(data)), nprocs=2)
    return h.load_results(root, 2)


@pytest.mark.slow
def test_the_async_writers_barrier_fails_after_the_collective_timeout(two_ranks):
    """Bounds how long a rank whose loop raised waits for its save in flight when a peer is gone."""
    got = two_ranks[0]["barrier"]
    assert got["result"] != "returned" and 1.5 < got["seconds"] < 10, got


@pytest.mark.slow
def test_a_damaged_shard_fails_the_resume_on_every_rank_at_once(two_ranks):
    """Rank 1's checksum error reaches rank 0 at the load, not as a collective timeout later."""
    mine, peer = two_ranks[1]["corrupt"], two_ranks[0]["corrupt"]
    assert mine["error"] == "ChecksumMismatchError" and "shard-00001-of-00002" in mine["message"], mine
    assert peer["error"] == "PeerCheckpointError" and "failed on rank 1 of 2" in peer["message"], peer
    assert peer["seconds"] < 5, peer  # parallel.collective_timeout_s=5 would be the other way to find out


@pytest.mark.parametrize("name_part,value", [(".mlp.experts.w_gate_up", float("nan")), ("exp_avg_sq", float("inf"))])
def test_a_checkpoint_holding_nan_or_inf_is_refused_and_no_checkpoint_is_deleted(tmp_path, data_dir, make_config,
                                                                                 name_part, value):
    """A non-finite master weight or moment is never a resume point: the resume fails naming the tensor, before
    training a step, and retention (keep_last) does not get to delete the older, good checkpoint."""
    from moe_ckpt import NonFiniteTensorError, ShardSpec, load_checkpoint, load_metadata, save_checkpoint

    cfg = make_config(tmp_path, steps=4, eval_interval=0, save_interval=2)
    cfg.data.path = str(data_dir)
    cfg.train.keep_last = 2
    Trainer(cfg).train()
    root = tmp_path / "run" / "checkpoints"
    last = step_dir(root, 4)
    data = load_checkpoint(last)
    bad = next(n for n in data if name_part in n and data[n].is_floating_point())
    data[bad].view(-1)[3] = value
    meta = load_metadata(last)
    shutil.rmtree(last)
    save_checkpoint(last, [ShardSpec(n, tuple(t.shape), t) for n, t in data.items()], meta)
    before = sorted(p.name for p in root.iterdir())
    cfg.train.steps = 6
    with pytest.raises(NonFiniteTensorError, match=bad.replace(".", r"\.")):
        Trainer(cfg).train()
    assert sorted(p.name for p in root.iterdir()) == before
    assert not [r for r in read_metrics(tmp_path / "run") if isinstance(r.get("step"), int) and r["step"] > 4]


def test_a_resume_on_other_training_data_or_with_another_data_seed_says_so(tmp_path, data_dir, make_config):
    """The sampler continues at its position in the checkpoint's order: on a re-prepared or other data folder
    (another window count) that is not a continuation, and this run's data.seed is not used; both warn."""
    import warnings

    from moe_train.data import prepare_data, stdlib_documents

    cfg = make_config(tmp_path, steps=2, eval_interval=0, save_interval=2)
    cfg.data.path = str(data_dir)
    Trainer(cfg).train()

    def resume_warnings(**data):
        c = make_config(tmp_path, steps=3, eval_interval=0, save_interval=0)
        c.data.path = str(data_dir)
        for k, v in data.items():
            setattr(c.data, k, v)
        t = Trainer(c)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.restore(t.resume_point())
        return [str(w.message) for w in caught]

    assert not [m for m in resume_warnings() if "data" in m]
    assert any("data.seed=7 is ignored on resume" in m for m in resume_warnings(seed=7))
    docs = list(stdlib_documents(200_000))  # the data_dir fixture's documents
    other = prepare_data(docs[: len(docs) // 2 + 1], tmp_path / "other", vocab_size=512, source="stdlib-test")
    got = resume_warnings(path=str(other))
    assert any("windows of data.seq_len" in m and "re-prepared" in m for m in got), got


def test_a_resume_with_another_train_seed_says_the_seed_is_not_used(tmp_path, data_dir, make_config):
    """train.seed is read at step 0 only; a resume goes on from the checkpoint's random state. A changed data.seed
    warned and a changed train.seed did not (review helper 160, moe-train 0.27.23). The seed compared is step 0's,
    carried in every checkpoint: 0.27.23 compared the stored config's, the last resumed command's, so after a
    resume with seed 7 the original seed 5 was called ignored and 7 not (review helper 162, 0.27.24)."""
    import warnings

    def run_to(steps: int, seed: int) -> list[str]:
        c = make_config(tmp_path, steps=steps, eval_interval=0, save_interval=2)
        c.train.seed = seed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(c).train()
        return [str(w.message) for w in caught if "train.seed" in str(w.message)]

    def ignored(seed: int) -> list[str]:
        return [f"train.seed={seed} is ignored on resume: the run goes on from the checkpoint's random state (seeded "
                "with train.seed=5 at step 0); start a new train.run_dir for another seed"]

    assert run_to(2, 5) == []
    assert run_to(4, 7) == ignored(7)
    assert run_to(6, 5) == []  # step 0's seed again: nothing ignored
    assert run_to(8, 7) == ignored(7)



class SigtermAtStepTwo(LocalRuntime):
    """SIGTERM to this process after the second step, as torchrun sends it to the other ranks when one fails."""

    sent = False

    def step(self, lr):
        result = super().step(lr)
        if not self.sent and self.steps_done == 2:
            # the default action would end this test session: only send it where train() took the signal over
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL, "train() left SIGTERM to its default action"
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        self.steps_done += 1
        return result

    steps_done = 1


def test_a_sigterm_ends_the_run_with_an_end_event_like_ctrl_c_and_it_resumes(tmp_path, data_dir, make_config):
    cfg = make_config(tmp_path, steps=4, save_interval=1, eval_interval=0, log_interval=1)
    cfg.data.path = str(data_dir)
    trainer = Trainer(cfg, SigtermAtStepTwo(cfg, torch.device("cpu")))
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        trainer.train()
    end = read_metrics(tmp_path / "run")[-1]
    assert end["event"] == "end" and end["status"] == "interrupted" and "SIGTERM" in end["error"], end
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "train() must restore the handler"
    assert find_latest(tmp_path / "run" / "checkpoints") is not None
    assert Trainer(cfg).train()["step"] == 4
