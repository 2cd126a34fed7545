"""Trainer checkpoints through moe-ckpt: global tensors that resume on any parallel layout.

<run_dir>/checkpoints/step-XXXXXXXX/  one safetensors file per rank + index.json + metadata,
written under a temporary name and renamed when complete; `latest` names the newest complete one.
A value two shards share (`CheckpointShard.same_as`: LocalRuntime's fp32 master is its weight) is
stored once; a reader that wants optim.X.master of such a checkpoint gets the fp32 weight X.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_ckpt import (
    AsyncCheckpointer, Box, CheckpointError, CorruptMetadataError, DtypeMismatchError, FlatRange, LoadRequest,
    PeerCheckpointError, ShardSpec, UnsupportedFormatVersionError, check_rng_state, fail_together, find_latest,
    inspect_checkpoint, list_checkpoints, load_checkpoint, load_metadata, open_checkpoint, save_checkpoint, step_dir,
    step_of,
)
from moe_train.config import ConfigError
from moe_train.trainer.errors import TrainingError
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
         keep_last: int | None, async_saver: AsyncCheckpointer | None = None, barrier=None) -> Path:
    """Every rank calls this; each writes only what it owns. Returns the checkpoint's path."""
    specs = [ShardSpec(s.global_name, s.global_shape, s.tensor.detach(), _region(s.slice), writer=s.is_writer)
             for s in all_shards(runtime, model) if s.same_as is None]
    path = step_dir(checkpoint_root(run_dir), step)
    _refuse_non_finite(specs, runtime, path)
    barrier = barrier or runtime.barrier
    if async_saver is not None:
        async_saver.save(path, specs, metadata, runtime.rank, runtime.world_size, barrier, keep_last_n=keep_last)
    else:
        save_checkpoint(path, specs, metadata, runtime.rank, runtime.world_size, barrier, keep_last_n=keep_last)
    return path


def _refuse_non_finite(specs: list[ShardSpec], runtime: Runtime, path: Path) -> None:
    """Every rank raises TrainingError when any rank's state holds NaN or Inf (an update that overflowed: lr past
    float32's range, say): no step can follow it (each is skipped), a resume refuses such a checkpoint, and
    writing it would let retention delete the good ones. One all-reduce; the tensor is named by a rank holding it."""
    floats = [s.tensor for s in specs if s.tensor.is_floating_point()]
    finite = [torch.isfinite(t).all().to(runtime.device) for t in floats]  # step counts may sit on the CPU
    bad = runtime.all_reduce_sum((~torch.stack(finite).all()).float().reshape(1) if finite
                                 else torch.zeros(1, device=runtime.device))
    if bad.item() > 0:
        name = next((s.name for s in specs if s.tensor.is_floating_point() and not torch.isfinite(s.tensor).all()),
                    None)
        where = f"tensor {name!r} (rank {runtime.rank})" if name else "another rank's state"
        raise TrainingError(f"not saving {path.name}: {where} holds NaN or Inf, so no later step can be taken; the "
                            "checkpoints already saved are kept (lower train.lr, or check the run's settings)")


_TRAINER_METADATA = {  # what restore reads, and the JSON type each must be
    "step": int, "skipped_steps": int, "sampler": dict, "rng": dict, "layout": dict,
}


def check_trainer_metadata(path: Path) -> None:
    """The fields the trainer's resume reads are there with their types, before any tensor is loaded (the step, which
    must be its folder's, the sampler's position, every generator's state, the model config check_same_model
    compares): metadata.json that is valid JSON but edited or written by another program fails here naming the
    field, not as a KeyError half-way through restoring, nor by resuming unchecked. A damaged checkpoint's error
    names the way back (_naming_the_way_back)."""
    with _naming_the_way_back(path):
        _check_trainer_fields(path)


def _check_trainer_fields(path: Path) -> None:
    meta = load_metadata(path)
    where = path / "metadata.json"
    for key, kind in _TRAINER_METADATA.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            expected = "an integer >= 0" if kind is int else "an object"
            raise CorruptMetadataError(f"{where}: {key}={value!r}, expected {expected} (the trainer writes it)")
    if not isinstance(meta["layout"].get("world_size"), int) or meta["layout"]["world_size"] < 1:
        raise CorruptMetadataError(f"{where}: layout.world_size={meta['layout'].get('world_size')!r}, expected a "
                                   "positive integer (the trainer writes it)")
    # the step the run goes on from is the folder's: one the metadata contradicts is not what the save wrote
    if step_of(path) is not None and meta["step"] != step_of(path):
        raise CorruptMetadataError(f"{where}: step={meta['step']}, expected {step_of(path)} (the step of its folder, "
                                   f"{path.name}; the trainer writes both)")
    # what check_same_model compares: without it a checkpoint of another network would resume unchecked
    model = meta.get("config", {}).get("model") if isinstance(meta.get("config"), dict) else None
    if not isinstance(model, dict) or not model:
        raise CorruptMetadataError(f"{where}: config.model={model!r}, expected the model config of the run that "
                                   "wrote it (the trainer writes it; a resume compares it with this run's)")
    for key, (least, required) in _COUNTS.items():
        section, _, field = key.rpartition(".")
        value = (meta[section] if section else meta).get(field)
        if (required or value is not None) and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise CorruptMetadataError(f"{where}: {key}={value!r}, expected an integer >= {least} (the trainer "
                                       "writes it)")
    try:
        check_rng_state(meta["rng"])
    except ValueError as e:
        raise CorruptMetadataError(f"{where}: {e} (the trainer writes rank 0's generators there)") from None


# Integers a resume reads: (least value, required); the others are absent from older checkpoints.
_COUNTS = {"sampler.samples_seen": (0, True), "sampler.seed": (0, True), "sampler.seq_len": (1, True),
           "sampler.num_windows": (1, False), "consecutive_skips": (0, False), "initial_seed": (0, False)}


def check_run_dir_writable(run_dir: str | Path, saves: bool) -> None:
    """The run folder takes its log, and (saves: the run writes checkpoints) its checkpoints/ folder takes a new
    step folder: a checkpoints/ that is a file, a link to nothing, or a folder this job may not write (another
    user's, a read-only mount) is refused before the first step, not at the first save with the steps since lost.
    Probes by writing (a folder made and removed; metrics.jsonl opened to append): permission bits say nothing
    to root or of a read-only mount."""
    run = Path(run_dir)
    root, metrics = checkpoint_root(run), run / "metrics.jsonl"
    expected = "expected a run folder this job can write its log and checkpoints in"
    if metrics.exists():
        try:
            open(metrics, "ab").close()  # noqa: SIM115 - appends nothing
        except OSError as e:
            raise ConfigError(f"train.run_dir={str(run_dir)!r}: cannot write {metrics} ({e.strerror or e}); "
                              f"{expected}") from None
    if not saves:
        return
    if root.exists() and not root.is_dir():
        raise ConfigError(f"train.run_dir={str(run_dir)!r}: {root} is a file; expected the folder the run's "
                          "checkpoints are saved in (move the file away, or use another train.run_dir)")
    where = root if root.is_dir() or root.is_symlink() else run  # the first save makes checkpoints/ here
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=where))
    except OSError as e:
        raise ConfigError(f"train.run_dir={str(run_dir)!r}: cannot make a folder in {where} ({e.strerror or e}), as "
                          f"each checkpoint save does; {expected} (or train.save_interval=0 for a run that saves "
                          "none)") from None


def _reads(path: Path) -> bool:
    """Whether checkpoint `path` passes the checks a resume starts with, without reading its tensors: index.json,
    metadata.json (against index.json's checksum of it, when recorded) and the trainer's fields in it, every shard
    file's size and safetensors header (the shards' checksums are not computed: that would read every byte of them,
    on every rank)."""
    try:
        _check_trainer_fields(path)
        with open_checkpoint(path, verify=False) as opened:
            opened.check_all_files()
    except (CheckpointError, OSError):
        return False
    return True


def way_back(damaged: Path) -> str:
    """What to do about damaged checkpoint `damaged` of a run: the newest older checkpoint that reads, and the
    move that makes the run resume from it. Nothing is moved here: resuming silently from an older step would
    retrain steps, and let retention delete checkpoints, without anyone having decided to."""
    step = step_of(damaged)
    older = [p for p in list_checkpoints(damaged.parent) if step is not None and (step_of(p) or 0) < step]
    intact = next((p for p in reversed(older) if _reads(p)), None)
    aside = damaged.with_name(f"{damaged.name}.damaged")
    if intact is None:
        return (f"checkpoint {damaged} cannot be resumed from, and no older checkpoint in {damaged.parent} reads "
                f"either ({len(older)} checked); start again with train.resume=false and a new train.run_dir")
    return (f"checkpoint {damaged} cannot be resumed from; the newest older one that reads is {intact.name} (step "
            f"{step_of(intact)}; its metadata checked, its shards' sizes and headers but not their checksums). To resume from it, move the damaged one "
            f"aside (mv {damaged} {aside}: moe-train ignores that name) and start the run again")


@contextlib.contextmanager
def _naming_the_way_back(path: Path) -> Iterator[None]:
    """A CheckpointError raised inside, for checkpoint `path`, gets way_back(path) added to its message (the CLI
    prints the message alone), keeping its type. A checkpoint of a newer format is not damaged: not this error."""
    try:
        yield
    except (UnsupportedFormatVersionError, PeerCheckpointError):
        # another rank's failure is not evidence of damage here: that rank's own error names its cause (a damaged
        # file there gets the way back; a failed read of a sound one must not say "cannot be resumed from")
        raise
    except CheckpointError as err:
        raise _with_message(err, f"{err}. {way_back(path)}") from err


def _with_message(err: CheckpointError, message: str) -> CheckpointError:
    """A copy of `err` (same type, notes and traceback) whose message is `message`."""
    copy = type(err)(message)
    for note in getattr(err, "__notes__", []):
        copy.add_note(note)
    return copy.with_traceback(err.__traceback__)


def latest(run_dir: str | Path) -> Path | None:
    root = checkpoint_root(run_dir)
    return find_latest(root) if root.is_dir() else None


def entries_after_step(root: Path, step: int) -> list[Path]:
    """What `root` holds named as a checkpoint of a step past `step` (complete or not, folder or not), by name."""
    later = (p for p in root.iterdir() if (p_step := step_of(p)) is not None and p_step > step)
    return sorted(later, key=lambda p: p.name)


def newest_checkpoint(path: str | Path) -> Path | None:
    """What a source path given to export-hf, inspect or train.init_from reads: the newest complete checkpoint of a
    run folder, or of a run's checkpoints/ folder given directly; None for anything else (a checkpoint folder itself,
    an import-hf output), which is read as given. A folder named as a later step that is no complete checkpoint (no
    index.json: never committed, or damaged) is warned about, since the step read is then not the run's last."""
    found = latest(path) or find_latest(path)
    if found is not None:
        newer = [p.name for p in entries_after_step(found.parent, step_of(found)) if p.is_dir() and not p.is_symlink()]
        if newer:
            warnings.warn(f"{found.parent}: {', '.join(newer)} {'is' if len(newer) == 1 else 'are'} named as a later "
                          f"step but {'holds' if len(newer) == 1 else 'hold'} no index.json (never committed, or "
                          f"damaged): reading {found.name}, the newest complete checkpoint", stacklevel=2)
    return found


def _is_param_step(name: str) -> bool:
    return name.startswith("optim.") and name.endswith(".step") and name != "optim.step"


def master_of(name: str) -> str | None:
    """X for a master weight's shard name optim.X.master, else None."""
    if name.startswith("optim.") and name.endswith(".master"):
        return name[len("optim."):-len(".master")]
    return None


def _stored_name(name: str, saved: dict[str, dict], one_step_count: bool) -> str:
    """The saved tensor holding `name`: itself; for a master saved once as its fp32 weight, the weight; for a
    parameter's step count in a checkpoint with one count for all (one_step_count: moe-train <= 0.5), optim.step."""
    weight = master_of(name)
    if name not in saved and weight is not None and weight in saved:
        return weight  # that it is float32 is checked once read (_read): index.json's dtype is not trusted before it
    if one_step_count and _is_param_step(name):
        return "optim.step"
    return name  # a name the checkpoint lacks is reported by load_checkpoint


def _read(path: Path, shards: list[CheckpointShard], device: torch.device) -> dict[str, torch.Tensor]:
    """{shard name: its slice} for a resume: optimizer state too."""
    saved = inspect_checkpoint(path)["tensors"]
    one_step_count = "optim.step" in saved and not any(map(_is_param_step, saved))
    wanted = {s.global_name: (_stored_name(s.global_name, saved, one_step_count), s) for s in shards}
    got = read_regions(path, wanted, device)  # a shard whose header disagrees with index.json is refused here
    for name, (stored, _) in wanted.items():
        if stored != name and stored == master_of(name) and got[name].dtype != torch.float32:
            raise DtypeMismatchError(f"checkpoint {path}: {name} is not saved, and its weight {stored} is "
                                     f"{got[name].dtype}: a master is saved once as its weight only when that weight "
                                     "is float32 (a bf16-resident run saves its fp32 masters apart); the checkpoint "
                                     "lacks the fp32 master")
    return got


def read_regions(path: Path, wanted: dict[str, tuple[str, CheckpointShard]],
                 device: torch.device) -> dict[str, torch.Tensor]:
    """{name: the region of its shard, read from the checkpoint's tensor of the stored name} for wanted = {name:
    (stored name, shard)}. load_checkpoint takes each saved name once per call, and a saved weight may be wanted
    at two regions (as itself and as a master), hence one call per such repeat."""
    wanted = {name: (stored, s.global_shape, _region(s.slice)) for name, (stored, s) in wanted.items()}
    passes: list[dict[str, tuple]] = []
    for key in dict.fromkeys(wanted.values()):
        todo = next((p for p in passes if key[0] not in p), None)
        if todo is None:
            passes.append(todo := {})
        todo[key[0]] = key
    got: dict[tuple, torch.Tensor] = {}
    for todo in passes:
        # dtype unchecked: resident weights may be bf16 on one layout and fp32 on another; copy_ casts.
        # NaN/Inf anywhere is refused before any state is touched: no training state holds them (a step
        # with a non-finite loss is skipped, and save refuses weights an update made non-finite), and resuming
        # from one would let retention delete good ones.
        data = load_checkpoint(path, [LoadRequest(*key[:2], None, key[2]) for key in todo.values()], device=device,
                               require_finite=True)
        got.update((key, data[name]) for name, key in todo.items())
    return {name: got[key] for name, key in wanted.items()}


def load(path: Path, runtime: Runtime, model: nn.Module) -> dict[str, Any]:
    """Read exactly the slices this rank now owns (any layout may have written them); returns metadata.

    Every rank calls this; if any rank's read fails (a damaged shard file), every rank raises, the
    others naming the rank that failed, instead of waiting at their next collective."""
    shards = all_shards(runtime, model)
    names = [s.global_name for s in shards]
    if len(set(names)) != len(names):
        raise RuntimeError("a rank holds two slices of one tensor; the checkpoint reader expects one")
    with _naming_the_way_back(path):
        # metadata.json is read inside the agreement too: a read error there on one rank alone would otherwise
        # leave the others at their next collective (QA 109)
        data, meta = fail_together(lambda: (_read(path, shards, runtime.device), load_metadata(path)),
                                   runtime.rank, runtime.world_size,
                                   lambda flags: runtime.all_reduce_sum(flags.to(runtime.device)).cpu(),
                                   f"loading {path}")
    runtime.load_checkpoint_shards(lambda name, _slice: data[name])
    params = {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        for s in shards:
            if s.global_name not in params and not s.global_name.startswith("optim."):
                s.tensor.copy_(data[s.global_name].reshape(s.tensor.shape))
    return meta
