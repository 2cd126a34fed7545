"""Training pieces of test_step_counts_resume.py (importable by name, so spawned ranks can unpickle them).

A small model whose branches run on some steps only: a parameter left without a gradient on a step keeps
its AdamW step count (torch.optim.AdamW skips grad=None; DistributedAdamW does the same). It is trained
through the trainer's runtimes (make_runtime: LocalRuntime on one process, DistributedRuntime on gloo
ranks) and checkpointed through moe_train.trainer.checkpoint, as the Trainer does.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import test_parallel_harness as h
from moe_ckpt import ShardSpec, inspect_checkpoint, load_checkpoint, load_metadata, save_checkpoint, step_dir
from moe_train.config import Config
from moe_train.trainer import checkpoint as ckpt
from moe_train.trainer.launch import make_runtime

D_IN, D, CLASSES, ROWS = 6, 16, 5, 8  # ROWS: the global batch, split over the data-parallel ranks
STEPS, SAVE_AT = 6, 3
LR = 1e-2


class Branchy(nn.Module):
    """`gate` runs on even steps, `late` from step 4 on (after the checkpoint), `never` on no step."""

    def __init__(self):
        super().__init__()
        self.never = nn.Parameter(torch.randn(5, 7))
        self.inp = nn.Linear(D_IN, D)
        self.gate = nn.Parameter(torch.randn(D) / 4)
        self.late = nn.Parameter(torch.randn(D, D) / D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        """x: [T, D_IN], y: [T] -> mean cross-entropy."""
        h = torch.tanh(self.inp(x))
        if step % 2 == 0:
            h = h * (1 + self.gate)
        if step >= 4:
            h = h + torch.tanh(h @ self.late)
        return F.cross_entropy(self.head(h), y)


# step counts at the checkpoint (3 steps: gate ran on steps 0 and 2) and after the 6 steps
COUNTS_AT_SAVE = {"never": 0, "inp.weight": 3, "inp.bias": 3, "gate": 2, "late": 0, "head.weight": 3, "head.bias": 3}
COUNTS_AT_END = {"never": 0, "inp.weight": 6, "inp.bias": 6, "gate": 3, "late": 2, "head.weight": 6, "head.bias": 6}


def config(run_dir: Path, dp: int) -> Config:
    cfg = Config()
    t = cfg.train
    t.lr, t.beta1, t.beta2, t.weight_decay, t.grad_clip = LR, 0.9, 0.95, 0.1, 1.0
    t.device, t.run_dir = "cpu", str(run_dir)
    cfg.parallel.dp = dp
    return cfg


def batch(step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS, D_IN, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)
    rows = slice(dp_rank * ROWS // dp_size, (dp_rank + 1) * ROWS // dp_size)
    return x[rows], y[rows]


def step_counts(runtime) -> dict[str, int]:  # noqa: ANN001
    """The per-parameter step counts the runtime would checkpoint."""
    return {s.global_name[len("optim."):-len(".step")]: int(s.tensor.item()) for s in runtime.checkpoint_shards()
            if s.global_name.startswith("optim.") and s.global_name.endswith(".step") and s.global_name != "optim.step"}


def train(run_dir: Path, dp: int, steps: int = STEPS, resume_from: Path | None = None) -> dict:
    """Train to `steps` (from resume_from's step when given), saving at SAVE_AT; the weights and step counts."""
    cfg = config(run_dir, dp)
    rt = make_runtime(cfg, torch.device("cpu"))
    try:
        torch.manual_seed(0)
        model = rt.setup(Branchy())
        out: dict = {"runtime": type(rt).__name__}
        start = 0
        if resume_from is not None:
            start = int(ckpt.load(resume_from, rt, model)["step"])
            out["counts_at_resume"] = step_counts(rt)
        for step in range(start, steps):
            rt.backward(model(*batch(step, rt.dp_rank, rt.dp_size), step), last_micro_batch=True)
            rt.step(LR)
            if step + 1 == SAVE_AT:
                ckpt.save(run_dir, SAVE_AT, rt, model, {"step": SAVE_AT}, keep_last=1)
        out["counts"] = step_counts(rt)
        out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return out
    finally:
        rt.close()


def saved_at(run_dir: Path) -> Path:
    return step_dir(ckpt.checkpoint_root(run_dir), SAVE_AT)


def with_one_step_count(src: Path, run_dir: Path) -> Path:
    """src rewritten by moe-ckpt without the per-parameter step counts: the checkpoint moe-train 0.5.0 wrote
    (only optim.step). Returns the new checkpoint."""
    names = [n for n in inspect_checkpoint(src)["tensors"]
             if not (n.startswith("optim.") and n.endswith(".step") and n != "optim.step")]
    data = load_checkpoint(src)
    dst = saved_at(run_dir)
    save_checkpoint(dst, [ShardSpec(n, tuple(data[n].shape), data[n]) for n in names], load_metadata(src))
    return dst


def worker(rank: int, ports: list[int], root: str) -> dict:
    """Two gloo ranks (a fresh process group per run): DP2 unbroken, DP2 resumed from its own checkpoint, and
    DP2 resumed from the one-process run's checkpoint in both formats."""
    root_ = Path(root)
    runs = [("dp2", None), ("dp2_resumed", saved_at(root_ / "dp2")), ("one_to_dp2", saved_at(root_ / "one")),
            ("one_step_count_to_dp2", saved_at(root_ / "one_step_count"))]
    out = {}
    for port, (name, resume_from) in zip(ports, runs):
        h.worker_env(rank, 2, port)
        out[name] = train(root_ / name, 2, resume_from=resume_from)  # closes the process group
    return out
