"""QA 129: checkpoints resumed on other parallel layouts, beyond test_layout_resume.py's four pairs.

Spawned ranks import this module by name (test_qa129_layout_fuzz.py and the hand-run qa129_sweep.py). A layout is
named by a short key ("dp4ep2-bf16", "dp2-ga4", "1"); `layout_config` turns (key, variant) into a Config. Every
run trains the same 12-expert model on 24 sequences of 16 tokens a step (24 = dp x micro_batch_size x grad_accum
for dp 1-4), fp32 unless the key says bf16, and saves at step 3 (the resume point) and at the end.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import test_parallel_harness as h
from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig

GLOBAL_BATCH = 24  # sequences a step: divisible by dp 1, 2, 3, 4 with grad_accum 2
NUM_EXPERTS = 12  # divisible by ep 1, 2, 3, 4
STEPS = 6
RESUME_STEP = 3


def model_config(**overrides) -> ModelConfig:
    router = {"top_k": 2, "expert_bias": True, "lb_loss_scope": "global", **overrides.pop("router", {})}
    fields = {"vocab_size": 512, "d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "qk_norm": True,
              "dense_hidden": 64, "dense_layers": [0], "num_experts": NUM_EXPERTS, "expert_hidden": 8,
              "shared_expert_hidden": 16, **overrides}
    return ModelConfig(router=RouterConfig(**router), **fields)


_KEY = re.compile(r"^(?:1|dp(\d)(?:ep(\d))?)((?:-[a-z0-9]+)*)$")


def layout_config(key: str, data: Path, run_dir: Path, *, train: dict | None = None, model: dict | None = None,
                  data_fields: dict | None = None) -> Config:
    """The Config of layout `key`: "1" or "dp{D}[ep{E}]", then options: -bf16 (parallel.param_dtype), -nodo
    (distributed_optimizer false), -cap (expert_capacity_factor 1.0), -fsdp, -ga{N} (grad_accum N, the micro-batch
    re-split so the global batch stays 24), -async (train.async_save)."""
    m = _KEY.match(key)
    if m is None:
        raise ValueError(f"layout key {key!r}")
    dp, ep = int(m[1] or 1), int(m[2] or 1)
    opts = [o for o in m[3].split("-") if o]
    accum = next((int(o[2:]) for o in opts if o.startswith("ga")), 2)
    t = {"steps": STEPS, "micro_batch_size": GLOBAL_BATCH // (dp * accum), "grad_accum": accum, "warmup_steps": 2,
         "eval_interval": 0, "log_interval": 1, "save_interval": RESUME_STEP, "run_dir": str(run_dir),
         "progress": False, "device": "cpu", "threads": 1, "async_save": "async" in opts, **(train or {})}
    cfg = Config(model=model_config(**(model or {})), data=DataConfig(**{"path": str(data), "seq_len": 16, **(data_fields or {})}),
                 train=TrainConfig(**t), preset="test")
    p = cfg.parallel
    p.dp, p.ep = dp, ep
    p.param_dtype = "bf16" if "bf16" in opts else "fp32"
    p.distributed_optimizer = "nodo" not in opts
    p.expert_capacity_factor = 1.0 if "cap" in opts else 0.0
    if "fsdp" in opts:
        p.strategy, cfg.train.save_interval = "fsdp", 0
    return cfg


def world_of(key: str) -> int:
    m = _KEY.match(key)
    return int(m[1] or 1) if m else 1


# ---- what a run left -----------------------------------------------------------------------------------------
def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def eval_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in records(run_dir) if "eval_loss" in r}


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-????????"))


def final_state(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The model's global tensors at `step` from the run's checkpoint: fp32 masters where saved (a bf16-resident
    run's weights are rounded copies), else the weights; and the routers' expert bias."""
    from moe_ckpt import load_checkpoint

    saved = load_checkpoint(run_dir / "checkpoints" / f"step-{step:08d}")
    out = {n: t.float() for n, t in saved.items() if not n.startswith("optim.")}
    for name in list(out):
        if f"optim.{name}.master" in saved:
            out[name] = saved[f"optim.{name}.master"].float()
    return out


def max_rel_loss_diff(got: dict[int, float], want: dict[int, float], steps) -> float:
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)


def max_state_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], only: str = "") -> float:
    """The largest absolute difference of the tensors whose name holds `only` (nan: there are none)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((float((a[n] - b[n]).abs().max()) for n in a if only in n), default=float("nan"))


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every file under run_dir (but the job lock, which any job rewrites) -> a digest of its bytes."""
    return {str(p.relative_to(run_dir)): hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


def seed_run_dir(src: Path, dst: Path, step: int = RESUME_STEP) -> None:
    """A new run folder holding only src's checkpoint at `step` (the job moved to another layout)."""
    name = f"step-{step:08d}"
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)


# ---- running -------------------------------------------------------------------------------------------------
def run_trainer(cfg: Config, switch: tuple[int, int] | None = None) -> None:
    """Train cfg; switch=(micro_batch_size, grad_accum): take those from step RESUME_STEP + 1 on, in the same
    process without a checkpoint (the oracle for a resume that re-splits the batch where the split changes the
    trajectory by design: the balancing loss is per micro-batch, capacity counts a micro-batch's tokens)."""
    from moe_train.trainer.loop import Trainer

    if switch is None:
        Trainer(cfg).train()
        return

    class Switching(Trainer):
        def _train_step(self) -> dict[str, float]:
            if self.step == RESUME_STEP:
                self.cfg.train.micro_batch_size, self.cfg.train.grad_accum = switch
            return super()._train_step()

    Switching(cfg).train()


@dataclass
class Job:
    """One run of a sweep or test. refused: it must raise before it trains (its error text comes back); switch:
    run_trainer's; seed=(src, dst): dst is first seeded with src's step-3 checkpoint (src: an earlier job's run);
    resave_to: restore the checkpoint only and save that state at once into resave_to/checkpoints (no step)."""

    cfg: Config
    refused: bool = False
    switch: tuple[int, int] | None = None
    seed: tuple[Path, Path] | None = None
    resave_to: Path | None = None


def run_job(job: Job) -> str | None:
    """Run job (its folder already seeded); a refusal's error text, "no error" for a refusal that did not come,
    None for a run."""
    if job.resave_to is not None:
        resave(job.cfg, job.resave_to)
    elif not job.refused:
        run_trainer(job.cfg, job.switch)
    else:
        try:
            run_trainer(job.cfg)
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            return f"{type(e).__name__}: {e}"
        return "no error"
    return None


def worker(rank: int, world: int, ports: list[int], jobs: list[Job], out_dir: str) -> None:
    """Each job in turn as one rank of a fresh process group, {run_dir: run_job's result} back. A seeded job's folder
    is seeded by rank 0 while the others wait (no process group lives between jobs)."""
    def body(_rank: int) -> dict:
        out = {}
        for i, (port, job) in enumerate(zip(ports, jobs)):
            if job.seed is not None:
                seeded = Path(out_dir) / f"seeded-{i}"
                if rank == 0:
                    seed_run_dir(*job.seed)
                    seeded.touch()
                while not seeded.exists():
                    time.sleep(0.05)
            h.worker_env(rank, world, port)
            out[job.cfg.train.run_dir] = run_job(job)
            h.release_process_groups()  # a refused run's Trainer may have closed it already; one that raised first not
        return out
    h.run_guarded(rank, body, out_dir)


def spawn(world: int, jobs: list[Job], out_dir: Path) -> list[dict]:
    """Run jobs on `world` gloo ranks; a job that is not a refusal and fails fails the spawn."""
    return h.spawn_jobs(worker, world, jobs, out_dir)


# ---- load at one layout, save again at once: the state must come back unchanged ------------------------------
def resave(cfg: Config, out_dir: Path) -> None:
    """Resume cfg's run folder (restore only, no step) and save that state at once into out_dir/checkpoints."""
    from moe_train.trainer.loop import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.restore(trainer.resume_point())
        trainer.run_dir = out_dir
        trainer.save()
    finally:
        trainer.runtime.close()
        trainer._release_run_dir()


def round_trip_differences(saved: Path, resaved: Path, resident_bf16: bool) -> list[str]:
    """Where checkpoint `resaved` (loaded and saved again at once, at another layout) holds other values than `saved`:
    masters, moments, step counts and buffers bit for bit (a master stored once as its fp32 weight is that weight),
    each weight the saved master (rounded to bf16 where the resaving run keeps bf16 weights)."""
    from moe_ckpt import load_checkpoint

    a, b = load_checkpoint(saved), load_checkpoint(resaved)
    params = {n for n in a if f"optim.{n}.exp_avg" in a}
    out = []

    def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            diff = float((got.double() - want.double()).abs().max()) if got.shape == want.shape else "another shape"
            out.append(f"{name}: {got.dtype} vs {want.dtype}, max diff {diff}")

    for name in sorted(set(a) | set(b)):
        if name.endswith(".master") or (name in a) != (name in b):
            if not name.endswith(".master"):
                out.append(f"{name}: only in {'the resaved' if name in b else 'the saved'} checkpoint")
            continue
        if name in params:
            master = a.get(f"optim.{name}.master", a[name])
            compare(f"optim.{name}.master", b.get(f"optim.{name}.master", b[name]), master)
            compare(name, b[name], master.to(torch.bfloat16) if resident_bf16 else master)
        else:
            compare(name, b[name], a[name])
    from moe_ckpt import load_metadata

    ma, mb = load_metadata(saved), load_metadata(resaved)
    out += [f"metadata {key}: {mb.get(key)!r} vs {ma.get(key)!r}" for key in
            ("step", "skipped_steps", "consecutive_skips", "sampler", "rng", "first_eval_loss", "last_eval_loss")
            if ma.get(key) != mb.get(key)]
    return out
