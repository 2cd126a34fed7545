"""The trainer's DistributedRuntime path on NCCL, at world size 1 on one GPU.

Every multi-rank trainer test runs on gloo with CPU tensors, but NCCL takes only CUDA tensors: a collective of the
DistributedRuntime path handed a CPU tensor (fail_together, ranks_agree_on, the non-finite-loss all-reduce, the
checkpoint and init_from checks, the data-opening checks) fails only on real GPUs. A config that is not "plain"
(here bf16 resident weights, parallel.backend="nccl") makes launch.make_runtime build a DistributedRuntime over an
NCCL process group of one rank (in-process HashStore), so these tests drive that path through the real Trainer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import init_from_worker as init_w
import nonfinite_loss_worker as nonfinite_w
from moe_ckpt import load_checkpoint, step_dir
from moe_train.data import DataError
from moe_train.trainer import loop
from moe_train.trainer.distributed_runtime import DistributedRuntime
from moe_train.trainer.loop import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKEND = "nccl"


@pytest.fixture(autouse=True)
def one_process_world(monkeypatch):
    """No launcher variables (make_runtime then takes world 1 with an in-process store), and no default process
    group left behind for the next test, whichever way this one ends."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def nccl_config(make_config, root: Path, data_dir: Path, **train):
    """The small test model on the GPU, run folder root/"run", through a DistributedRuntime on NCCL: bf16 resident
    weights (fp32 masters in the distributed optimizer) make the config not "plain"."""
    cfg = make_config(root, device="cuda", **train)
    cfg.data.path = str(data_dir)
    cfg.parallel.backend = BACKEND
    cfg.parallel.param_dtype = "bf16"
    return cfg


def assert_on_nccl(trainer: Trainer) -> None:
    assert isinstance(trainer.runtime, DistributedRuntime), type(trainer.runtime)
    assert dist.is_initialized() and dist.get_backend() == BACKEND
    assert trainer.runtime.world_size == 1
    assert next(trainer.model.parameters()).dtype == torch.bfloat16  # the resident weights


@pytest.fixture
def built_runtimes(monkeypatch):
    """(runtime type, backend) of each runtime the Trainer builds: a Trainer refused in its constructor is gone
    before the test can look at it."""
    seen: list[tuple[type, str]] = []
    real = loop.make_runtime

    def recording(cfg, device):
        rt = real(cfg, device)
        seen.append((type(rt), dist.get_backend() if dist.is_initialized() else None))
        return rt
    monkeypatch.setattr(loop, "make_runtime", recording)
    return seen


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in before if not torch.equal(before[n], after[n])]


def step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "event" not in r]


def test_training_on_nccl_with_bf16_weights_resumes_to_the_unbroken_runs_state(tmp_path, data_dir, make_config):
    """4 steps in one go against 2 steps, a checkpoint (its non-finite check and barrier on NCCL) and a resumed run
    (the resume checks: fail_together, ranks_agree_on) to 4: the step-4 checkpoints agree.

    Tolerances: AdamW step counts exactly. Tensors to 5e-3 of their norm, as test_model_gpu.py's fp32 version: the
    bf16 autocast forward and atomics in the expert backward are not bit-reproducible on a GPU, and a one-ulp
    difference in a master can flip the bf16 rounding of its resident weight (2**-8 ~ 3.9e-3 of that element), so
    exact equality is not expected there; a broken resume (fresh moments, another data order, a lost step) moves
    the moments and weights by far more (O(1) of exp_avg's norm)."""
    def run(name: str, steps: int):
        trainer = Trainer(nccl_config(make_config, tmp_path / name, data_dir, steps=steps, eval_interval=0,
                                      save_interval=2, log_interval=1))
        assert_on_nccl(trainer)
        summary = trainer.train()
        assert not dist.is_initialized(), "the Trainer did not destroy its process group"
        return summary, tmp_path / name / "run" / "checkpoints"

    _, unbroken = run("unbroken", 4)
    run("resumed", 2)
    summary, resumed = run("resumed", 4)
    assert summary["step"] == 4
    starts = [json.loads(x) for x in (tmp_path / "resumed" / "run" / "metrics.jsonl").read_text().splitlines()
              if '"start"' in x]
    assert [s["resumed_from_step"] for s in starts] == [None, 2]
    want, got = load_checkpoint(step_dir(unbroken, 4)), load_checkpoint(step_dir(resumed, 4))
    assert set(want) == set(got)
    assert want["embed.weight"].dtype == torch.bfloat16 and want["optim.embed.weight.master"].dtype == torch.float32
    steps = [n for n in want if n.startswith("optim.") and n.endswith(".step")]
    assert len(steps) > 1 and all(float(want[n]) == float(got[n]) == 4.0 for n in steps)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.isfinite(got[name]).all(), name
        assert rel(got[name], t) < 5e-3, (name, rel(got[name], t))


def test_an_infinite_loss_on_nccl_applies_no_update(tmp_path, data_dir, make_config):
    """The loss's all-reduce (a CUDA tensor) is +inf on step 2: no update and no optimizer step, the others train."""
    cfg = nccl_config(make_config, tmp_path, data_dir, steps=3, eval_interval=0, save_interval=0, log_interval=1,
                      max_skipped_steps=3)
    trainer = Trainer(cfg)
    assert_on_nccl(trainer)
    nonfinite_w.poison_loss(trainer)
    snapshots = nonfinite_w.record_weights_per_step(trainer)
    summary = trainer.train()
    assert not dist.is_initialized(), "the Trainer did not destroy its process group"
    assert len(snapshots) == 4
    assert changed(snapshots[1], snapshots[2]) == [], "the step with an infinite loss changed the weights"
    assert changed(snapshots[0], snapshots[1]) and changed(snapshots[2], snapshots[3]), "the other steps train"
    assert trainer.skipped_steps == 1 and summary["skipped_steps"] == 1
    counts = set(trainer.runtime.optimizer.param_step_counts().values())
    assert counts == {2}, f"AdamW took {counts} steps, expected 2 of the 3 (the poisoned one is not a step)"
    records = step_records(tmp_path / "run")
    assert [r["skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None  # non-finite: written as null


def test_init_from_on_nccl_starts_from_the_source_runs_fp32_masters(tmp_path, data_dir, make_config):
    """train.init_from = a finished run's folder (ranks_agree_on and the read's fail_together on NCCL): before the
    first step the fp32 masters are the source checkpoint's masters, the bf16 weights those rounded, the expert
    bias the source's, and the optimizer state fresh."""
    src = Trainer(nccl_config(make_config, tmp_path / "src", data_dir, steps=3, eval_interval=0, save_interval=3,
                              log_interval=1))
    assert_on_nccl(src)
    src.train()
    src_run = tmp_path / "src" / "run"
    source = load_checkpoint(step_dir(src_run / "checkpoints", 3))

    trainer = Trainer(nccl_config(make_config, tmp_path / "b", data_dir, steps=2, eval_interval=0, save_interval=2,
                                  log_interval=1, init_from=str(src_run)))
    assert_on_nccl(trainer)
    seen = init_w.before_first_step(trainer)
    summary = trainer.train()
    assert not dist.is_initialized(), "the Trainer did not destroy its process group"
    assert summary["step"] == 2 and trainer.step == 2

    masters_seen, masters_unlike_weights = 0, 0
    for name, (_, _, t) in seen["shards"].items():
        t = t.cpu()
        if name.startswith("optim."):
            if name.endswith(".master"):
                assert torch.equal(t, source[name].reshape(-1)), name
                masters_seen += 1
            else:
                assert not t.any(), f"{name}: expected fresh optimizer state"
        else:
            master = source[f"optim.{name}.master"]
            assert torch.equal(t, master.to(torch.bfloat16).float().reshape(t.shape)), name
            assert source[name].dtype == torch.bfloat16
            masters_unlike_weights += not torch.equal(source[name].float(), master)
    assert masters_seen > 1
    assert masters_unlike_weights > 0, "the source's masters equal its bf16 weights: not a check of which was read"
    for name, b in seen["buffers"].items():
        assert torch.equal(b.cpu(), source[name]), name
    assert any(b.any() for b in seen["buffers"].values()), "the source's expert bias is not zero: a real check"
    assert set(trainer.runtime.optimizer.param_step_counts().values()) == {2}, "AdamW's state did not start fresh"
    start = json.loads((tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["init_from"] == str(src_run / "checkpoints" / "step-00000003")


def test_a_token_file_changed_after_its_meta_stops_the_nccl_run_with_the_data_error(tmp_path, data_dir,
                                                                                   make_config):
    """Ids past the model's vocabulary written into train.u32 after meta.json: the first window drawn raises the
    DataError naming the file (not an embedding's device-side assert, nor an NCCL error), and the process group
    is destroyed."""
    tokens = np.fromfile(data_dir / "train.u32", dtype="<u4")
    tokens[::20] = 70_000  # every window of data.seq_len+1 = 33 tokens holds one; meta.json says otherwise
    tokens.tofile(data_dir / "train.u32")
    trainer = Trainer(nccl_config(make_config, tmp_path, data_dir, steps=2, eval_interval=0, save_interval=0))
    assert_on_nccl(trainer)
    with pytest.raises(DataError, match=r"train.u32 at token \d+: token id 70000 >= vocab_size=512"):
        trainer.train()
    assert not dist.is_initialized(), "the Trainer did not destroy its process group"
    end = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "end" and end["status"] == "failed" and end["error"].startswith("DataError: ")


@pytest.mark.parametrize("case", ["missing folder", "vocab larger than the model's"])
def test_a_data_folder_the_nccl_run_cannot_use_is_refused_at_start(case, tmp_path, data_dir, make_config,
                                                                   built_runtimes):
    """Refused in the Trainer's constructor, after the NCCL runtime exists (the checks on rank 0 and the data
    opening under fail_together): the DataError itself, the process group destroyed, no run folder left."""
    cfg = nccl_config(make_config, tmp_path, data_dir, steps=2, eval_interval=0, save_interval=0)
    if case == "missing folder":
        cfg.data.path = str(tmp_path / "nowhere")
        message = r"data.path='.*nowhere' does not exist"
    else:
        meta = json.loads((data_dir / "meta.json").read_text())
        meta["vocab_size"] = 1000
        (data_dir / "meta.json").write_text(json.dumps(meta))
        message = r"meta.json: the data was tokenized with vocab_size=1000, larger than model.vocab_size=512"
    with pytest.raises(DataError, match=message):
        Trainer(cfg)
    assert built_runtimes == [(DistributedRuntime, BACKEND)], "the refusal did not come through the NCCL runtime"
    assert not dist.is_initialized(), "the refused Trainer did not destroy its process group"
    assert not (tmp_path / "run").exists(), "a run refused for its data left a run folder behind"
