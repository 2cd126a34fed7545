"""The spawned ranks of test_qa97.py (importable by name, so spawned ranks can unpickle them): real Trainers whose
model's forwards are recorded, to compare the windows they were handed with a reference read from the files."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

import test_parallel_harness as h
from moe_train.config import Config
from moe_train.model import Transformer
from test_parallel_harness import small_config

SEQ_LEN = 64
GLOBAL_BATCH = 8  # windows a step, over all data-parallel ranks and micro-batches
STEPS = 6
SAVE_AT = 3
EVAL_WINDOWS = 4  # fewer than the eval split holds: a spread of them


def run_config(root: Path, data: Path, name: str, dp: int, micro: int) -> Config:
    """small_config on `data`: STEPS steps of GLOBAL_BATCH windows as dp ranks x micro x grad_accum, an eval of
    EVAL_WINDOWS windows every 3 steps (at 0, 3, 6), a checkpoint at step 3. `micro` should divide EVAL_WINDOWS
    into batches the dp ranks share evenly (a rank left without one repeats a batch, uncounted)."""
    cfg = small_config(root / name, steps=STEPS, micro_batch_size=micro, grad_accum=GLOBAL_BATCH // (dp * micro),
                       eval_interval=3, eval_windows=EVAL_WINDOWS, save_interval=SAVE_AT, log_interval=1, device="cpu",
                       threads=1)
    cfg.data.path, cfg.data.seq_len, cfg.data.seed = str(data), SEQ_LEN, 5
    cfg.train.run_dir = str(root / name)
    cfg.parallel.dp = dp
    return cfg


def seed_from(src: Path, dst: Path) -> None:
    """A new run folder holding only src's checkpoint at SAVE_AT (the run resumes there)."""
    name = f"step-{SAVE_AT:08d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)


def recorded_run(cfg: Config) -> list[tuple[bool, np.ndarray, np.ndarray]]:
    """Train cfg, returning every forward's (training?, inputs, targets) in the order the model saw them."""
    from moe_train.trainer.loop import Trainer

    seen = []
    loss_terms = Transformer.loss_terms  # what training calls, and eval through Transformer.loss

    def recording(model, tokens, targets):  # noqa: ANN001, ANN202
        seen.append((model.training, tokens.cpu().numpy().copy(), targets.cpu().numpy().copy()))
        return loss_terms(model, tokens, targets)

    Transformer.loss_terms = recording
    try:
        Trainer(cfg).train()
    finally:
        Transformer.loss_terms = loss_terms
    return seen


def jobs_dp2(rank: int, ports: list[int], jobs: list[Config]) -> dict:
    """Each job as one of two ranks of a fresh process group; returns each job's recorded forwards."""
    out = {}
    for port, cfg in zip(ports, jobs):
        h.worker_env(rank, 2, port)
        out[Path(cfg.train.run_dir).name] = recorded_run(cfg)
        h.release_process_groups()
    return out


def spawn_dp2(jobs: list[Config], out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    ports = [h.free_port() for _ in jobs]
    h.start_ranks(h.run_guarded, args=(jobs_dp2, str(out_dir), ports, jobs), nprocs=2)
    return h.load_results(out_dir, 2)

