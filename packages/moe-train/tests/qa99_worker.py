"""The runs of test_qa99.py (importable by name, so spawned ranks can unpickle them): one model and data recipe at
several parallel layouts, gloo ranks on the CPU, and what the test reads back from a run folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import qa76_worker
import test_parallel_harness as h
from moe_ckpt import LoadRequest, open_checkpoint, step_dir
from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig

GLOBAL_BATCH = 12  # sequences per optimizer step over every rank: dp x micro_batch_size x grad_accum
STEPS, STOP = 4, 2  # the unbroken runs' length; the checkpoint a stopped run resumes from


def model_config(**changes) -> ModelConfig:  # noqa: ANN003
    """Dense layer 0, MoE layers 1-2 with E=6 (ep 1, 2, 3 and 6 divide it; 4 does not), top-2 softmax, a shared
    expert and the auxiliary-loss-free expert bias. lb_loss_weight=0: the balancing loss is a product of
    per-micro-batch means, so two splits of one global batch (2 x 6 or 3 x 4 sequences) would train other
    functions; cross-entropy, z-loss and the bias's load are means / sums over equal micro-batches and are not."""
    fields = dict(vocab_size=512, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, qk_norm=True,
                  dense_hidden=48, dense_layers=[0], num_experts=6, expert_hidden=16, shared_expert_hidden=16,
                  router=RouterConfig(top_k=2, expert_bias=True, lb_loss_weight=0.0))
    return ModelConfig(**{**fields, **changes})


def run_config(run_dir: Path, data: Path, dp: int = 1, ep: int = 1, micro_batch_size: int = 12,
               param_dtype: str = "fp32", sharded: bool = True, model: ModelConfig | None = None) -> Config:
    """STEPS steps of GLOBAL_BATCH sequences of 16 tokens, a checkpoint and an eval every STOP steps, each step
    logged."""
    cfg = Config(
        model=model or model_config(),
        data=DataConfig(path=str(data), seq_len=16),
        train=TrainConfig(steps=STEPS, micro_batch_size=micro_batch_size,
                          grad_accum=GLOBAL_BATCH // (dp * micro_batch_size), warmup_steps=2, eval_interval=STOP,
                          eval_windows=4, log_interval=1, save_interval=STOP, keep_last=5, run_dir=str(run_dir),
                          progress=False, device="cpu", threads=1),
        preset="test",
    )
    p = cfg.parallel
    p.dp, p.ep, p.param_dtype, p.distributed_optimizer = dp, ep, param_dtype, sharded
    return cfg


def stopped_copy(src: Path, dst: Path, step: int = STOP) -> Path:
    """dst: src's run folder as a job stopped after `step` with its log past it leaves it: every file, the
    checkpoints after `step` left out."""
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if Path(d).name == "checkpoints"
                                                        and n.startswith("step-") and int(n[5:13]) > step])
    return dst


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_step(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, by its global name."""
    with open_checkpoint(checkpoint) as ck:
        return {name: ck.read([LoadRequest(name)])[name].clone() for name in ck.names}


def restore_and_save(cfg: Config, out: Path) -> None:
    """A Trainer of `cfg` resumes its run folder's checkpoint, takes no step, and saves what it restored into `out`
    (a run folder): every tensor as this layout holds it after the load, with the metadata it would save next."""
    from moe_train.trainer import checkpoint as ckpt
    from moe_train.trainer.loop import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.restore(trainer.resume_point())
        ckpt.save(out, trainer.step, trainer.runtime, trainer.model, trainer._metadata(), None)
    finally:
        trainer.runtime.close()
        trainer._release_run_dir()


def _job(kind: str, cfg: Config, out: str | None) -> str:
    from moe_train.trainer.loop import Trainer

    if kind == "restore":
        restore_and_save(cfg, Path(out))
        return ""
    trainer = Trainer(cfg)
    if kind == "stop":  # Ctrl-C during step STOP + 1, after its update: the run stops at STOP's checkpoint
        qa76_worker.ctrl_c_in_step(trainer, STOP + 1)
    try:
        trainer.train()
    except KeyboardInterrupt as e:
        return str(e)
    return ""


def worker(rank: int, world: int, ports: list[int], jobs: list[tuple], out_dir: str) -> None:
    """Run each job (kind, Config, out) in turn as one rank of a fresh process group."""
    def body(_rank: int) -> dict:
        said = []
        for port, (kind, cfg, out) in zip(ports, jobs):
            h.worker_env(rank, world, port)
            said.append(_job(kind, cfg, out))
            h.release_process_groups()
        return {"said": said}
    h.run_guarded(rank, body, out_dir)


def spawn(world: int, jobs: list[tuple], out_dir: Path) -> list[dict]:
    return h.spawn_jobs(worker, world, jobs, out_dir)


def checkpoint_of(run_dir: Path, step: int) -> Path:
    return step_dir(run_dir / "checkpoints", step)
