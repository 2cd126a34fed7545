"""Trainer checkpoints through moe-ckpt: global tensors that resume on any parallel layout.

<run_dir>/checkpoints/step-XXXXXXXX/  one safetensors file per rank + index.json + metadata,
written under a temporary name and renamed when complete; `latest` names the newest complete one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_ckpt import (
    AsyncCheckpointer, Box, FlatRange, LoadRequest, ShardSpec, find_latest, load_checkpoint, load_metadata,
    save_checkpoint, step_dir,
)
from moe_train.config import Config, ConfigError
from moe_train.trainer.runtime import CheckpointShard, Runtime, Slice


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _region(sl: Slice) -> Box | FlatRange:
    if hasattr(sl, "start"):  # a flat range of the flattened global tensor
        return FlatRange(int(sl.start), int(sl.length))
    return Box(tuple(o for o, _ in sl), tuple(n for _, n in sl))


def _buffer_shards(model: nn.Module, rank: int) -> list[CheckpointShard]:
    """Persistent buffers (e.g. the routers' expert bias): replicated, written by rank 0."""
    param_storage = {p.data_ptr() for p in model.parameters()}
    out = []
    for name, t in model.state_dict().items():
        if t.data_ptr() not in param_storage:  # tied weights (lm_head = embed) are saved once, as the parameter
            out.append(CheckpointShard(name, tuple(t.shape), tuple((0, n) for n in t.shape), t, rank == 0))
    return out


def all_shards(runtime: Runtime, model: nn.Module) -> list[CheckpointShard]:
    return runtime.checkpoint_shards() + _buffer_shards(model, runtime.rank)


def save(run_dir: str | Path, step: int, runtime: Runtime, model: nn.Module, metadata: dict[str, Any],
         keep_last: int, async_saver: AsyncCheckpointer | None = None, barrier=None) -> Path:
    """Every rank calls this; each writes only what it owns. Returns the checkpoint's path."""
    specs = [ShardSpec(s.global_name, s.global_shape, s.tensor.detach(), _region(s.slice), writer=s.is_writer)
             for s in all_shards(runtime, model)]
    path = step_dir(checkpoint_root(run_dir), step)
    barrier = barrier or runtime.barrier
    if async_saver is not None:
        async_saver.save(path, specs, metadata, runtime.rank, runtime.world_size, barrier, keep_last_n=keep_last)
    else:
        save_checkpoint(path, specs, metadata, runtime.rank, runtime.world_size, barrier, keep_last_n=keep_last)
    return path


# Model fields a resumed run may change: they set kernels, precision, initialisation or loss
# weights, not the network the saved tensors belong to.
TRAINING_ONLY_MODEL_FIELDS = frozenset({
    "model.gemm_backend", "model.precision", "model.init_std", "model.router.lb_loss_weight",
    "model.router.z_loss_weight", "model.router.expert_bias_rate", "model.router.lb_loss_scope",
})


def _flat(section: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in section.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_same_model(path: Path, cfg: Config) -> None:
    """Refuse to resume a checkpoint written for another model or sequence length: tensors of
    the same shapes would load silently into a different network (fewer layers, tied
    embeddings, another router)."""
    saved = load_metadata(path).get("config", {})
    saved_model, want_model = _flat(saved.get("model", {}), "model."), _flat(cfg.to_dict()["model"], "model.")
    diffs = [f"{k}: checkpoint {v!r}, this run {want_model.get(k)!r}" for k, v in sorted(saved_model.items())
             if k not in TRAINING_ONLY_MODEL_FIELDS and want_model.get(k) != v]
    saved_seq = saved.get("data", {}).get("seq_len")
    if saved_seq is not None and saved_seq != cfg.data.seq_len:
        diffs.append(f"data.seq_len: checkpoint {saved_seq}, this run {cfg.data.seq_len}")
    if diffs:
        raise ConfigError(f"{path} was written for another configuration ({'; '.join(diffs)}); "
                          "use the checkpoint's settings or a new train.run_dir")


def check_not_an_import(run_dir: str | Path) -> None:
    """An `import-hf` output holds weights the trainer does not start from (yet): training there
    would silently begin from a random init, so it is refused."""
    run = Path(run_dir)
    if (run / "model.safetensors").is_file() and (run / "hf_extra.json").is_file():
        raise ConfigError(f"train.run_dir={run_dir} holds an import-hf output (model.safetensors, hf_extra.json): "
                          "training does not start from imported weights yet and would begin from a random init; "
                          "use another train.run_dir")


def check_no_checkpoints_after(run_dir: str | Path, start_step: int, resume: bool) -> None:
    """Refuse to start when a checkpoint folder past `start_step` exists: the run would train up
    to it and then fail to save over it (an incomplete folder left by hand, or --no-resume on a
    run that has checkpoints)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return
    later = sorted(p.name for p in root.iterdir()
                   if (m := re.fullmatch(r"step-(\d+)", p.name)) and int(m.group(1)) > start_step)
    if later:
        why = (f"this run resumes from step {start_step}" if resume and start_step > 0
               else "this run starts from step 0 (no resume)" if not resume else "no complete checkpoint was found")
        raise ConfigError(f"train.run_dir={run_dir}: {root}/{later[0]} exists but {why}; the run would have to "
                          f"write over {', '.join(later)}. Move those folders away or use a new train.run_dir")


def latest(run_dir: str | Path) -> Path | None:
    root = checkpoint_root(run_dir)
    return find_latest(root) if root.is_dir() else None


def load(path: Path, runtime: Runtime, model: nn.Module) -> dict[str, Any]:
    """Read exactly the slices this rank now owns (any layout may have written them); returns metadata."""
    shards = all_shards(runtime, model)
    names = [s.global_name for s in shards]
    if len(set(names)) != len(names):
        raise RuntimeError("a rank holds two slices of one tensor; the checkpoint reader expects one")
    # dtype unchecked: resident weights may be bf16 on one layout and fp32 on another; copy_ casts.
    requests = [LoadRequest(s.global_name, s.global_shape, None, _region(s.slice)) for s in shards]
    data = load_checkpoint(path, requests, device=runtime.device)
    runtime.load_checkpoint_shards(lambda name, _slice: data[name])
    params = {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        for s in shards:
            if s.global_name not in params and not s.global_name.startswith("optim."):
                s.tensor.copy_(data[s.global_name].reshape(s.tensor.shape))
    return load_metadata(path)
