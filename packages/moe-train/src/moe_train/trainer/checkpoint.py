"""Trainer checkpoints through moe-ckpt: global tensors that resume on any parallel layout.

<run_dir>/checkpoints/step-XXXXXXXX/  one safetensors file per rank + index.json + metadata,
written under a temporary name and renamed when complete; `latest` names the newest complete one.
A value two shards share (`CheckpointShard.same_as`: LocalRuntime's fp32 master is its weight) is
stored once; a reader that wants optim.X.master of such a checkpoint gets the fp32 weight X.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_ckpt import (
    AsyncCheckpointer, Box, CheckpointError, CorruptMetadataError, FlatRange, LoadRequest, ShardSpec,
    UnsupportedFormatVersionError, fail_together, find_latest, inspect_checkpoint, list_checkpoints, load_checkpoint,
    load_metadata, open_checkpoint, save_checkpoint, step_dir, step_of,
)
from moe_train.config import Config, ConfigError, ModelConfig
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


_NOT_RECORDED = object()  # a model field the checkpoint's config predates


MOE_ONLY_FIELDS = ("model.dense_layers", "model.expert_hidden", "model.shared_expert_hidden", "model.shared_expert_gate")


def _network(model: dict[str, Any]) -> dict[str, Any]:
    """Flat model fields as the network they give: head_dim null is d_model // num_heads, dense_layers a
    set (order and repeats do not change which layers are dense), and a dense model (num_experts 0) without the
    fields only MoE layers read (an HF round trip resets them)."""
    out = dict(model)
    if out.get("model.num_experts") == 0:
        out = {k: v for k, v in out.items() if k not in MOE_ONLY_FIELDS and not k.startswith("model.router.")}
    d, heads = out.get("model.d_model"), out.get("model.num_heads")
    if out.get("model.head_dim") is None and isinstance(d, int) and isinstance(heads, int) and heads > 0:
        out["model.head_dim"] = d // heads
    dense = out.get("model.dense_layers")
    if isinstance(dense, list) and all(isinstance(i, int) for i in dense):
        out["model.dense_layers"] = sorted(set(dense))
    return out


def _as_given(flat: dict[str, Any], network: dict[str, Any], key: str) -> str:
    """A field's value as the config gave it, and what it amounts to where that differs (`None (= 16)`)."""
    value = flat.get(key, _NOT_RECORDED)
    if value is _NOT_RECORDED:
        return f"(not recorded: {network[key]!r})" if key in network else "(no such field)"
    return f"{value!r}" if network.get(key) == value else f"{value!r} (= {network.get(key)!r})"


def _top_1_renormalisation_dropped(saved: dict[str, Any], want: dict[str, Any]) -> set[str]:
    """{"model.router.normalize_top_k"} when a top-1 run saved with it true resumes with it false: training such a
    router is refused (its one weight renormalises to 1, so the loss never reaches the router), and turning it off
    is the fix the refusal names; the same tensors then weight each expert by its probability."""
    key = "model.router.normalize_top_k"
    top_1 = saved.get("model.router.top_k") == 1 == want.get("model.router.top_k")
    return {key} if top_1 and saved.get(key) is True and want.get(key) is False else set()


def model_differences(saved: dict[str, Any], cfg: Config) -> list[str]:
    """The network fields where a checkpoint's model section (`saved`) and cfg's differ, one "field: checkpoint
    X, this run Y" each; training-only fields may differ."""
    saved_model, want_model = _flat(saved, "model."), _flat(cfg.to_dict()["model"], "model.")
    defaults = _flat(dataclasses.asdict(ModelConfig()), "model.") if saved_model else {}
    saved_net = _network({**{k: v for k, v in defaults.items() if k in want_model}, **saved_model})
    want_net = _network(want_model)
    may_change = TRAINING_ONLY_MODEL_FIELDS | _top_1_renormalisation_dropped(saved_net, want_net)
    return [f"{k}: checkpoint {_as_given(saved_model, saved_net, k)}, this run {_as_given(want_model, want_net, k)}"
            for k, v in sorted(saved_net.items()) if k not in may_change and want_net.get(k) != v]


def check_same_model(path: Path, cfg: Config) -> None:
    """Refuse to resume a checkpoint written for another model or sequence length: tensors of
    the same shapes would load silently into a different network (fewer layers, tied
    embeddings, another router). Fields are compared as the network they give (_network); a
    field the checkpoint's config predates is taken at its default, what its writer computed."""
    saved = load_metadata(path).get("config", {})
    diffs = model_differences(saved.get("model", {}), cfg)
    saved_seq = saved.get("data", {}).get("seq_len")
    if saved_seq is not None and saved_seq != cfg.data.seq_len:
        diffs.append(f"data.seq_len: checkpoint {saved_seq}, this run {cfg.data.seq_len}")
    if diffs:
        raise ConfigError(f"{path} was written for another configuration ({'; '.join(diffs)}); "
                          "use the checkpoint's settings or a new train.run_dir")


_TRAINER_METADATA = {  # what restore reads, and the JSON type each must be
    "step": int, "skipped_steps": int, "sampler": dict, "rng": dict, "layout": dict,
}


def check_trainer_metadata(path: Path) -> None:
    """The fields the trainer's resume reads are there with their types, before any tensor is loaded: metadata.json
    that is valid JSON but edited or written by another program fails here naming the field, not as a KeyError
    half-way through restoring. A damaged checkpoint's error names the way back (_naming_the_way_back)."""
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


def check_not_past_the_end(path: Path, steps: int) -> None:
    """Refuse to resume from a checkpoint past train.steps: the run would train nothing and report the
    checkpoint's step as done (train.steps lowered, or the run folder of a longer run reused)."""
    step = step_of(path)
    if step is not None and step > steps:
        raise ConfigError(f"train.steps={steps}: the run in {path.parent.parent} has a checkpoint at step {step} "
                          f"({path.name}), past it, so there is nothing to train; expected train.steps >= {step} to "
                          "continue that run, or a new train.run_dir")


def eval_set_change(saved: dict[str, Any], cfg: Config, split_windows: int, step: int) -> str | None:
    """A one-line warning when this run, resumed at `step`, evaluates on another set of windows than the
    run that wrote the checkpoint (saved: its stored config); None when the eval losses stay comparable.

    Both sets are min(asked, split_windows) windows spread evenly over the eval split. moe-train 0.3.0
    stored train.eval_batches (eval_batches x micro_batch_size windows); 0.4.0 renamed it
    train.eval_windows, whose default of 64 differs from most old sets."""
    t = saved.get("train", {})
    if not t.get("eval_interval"):
        return None  # the checkpoint's run logged no eval losses to compare with
    if "eval_windows" in t:
        asked = int(t["eval_windows"])
    elif "eval_batches" in t:
        asked = int(t["eval_batches"]) * int(t["micro_batch_size"])
    else:
        return None
    before, now = min(asked, split_windows), min(cfg.train.eval_windows, split_windows)
    if before == now:
        return None
    return (f"eval losses before and after step {step} are not comparable: the run that wrote the checkpoint "
            f"evaluated {before} windows, this one evaluates {now} (train.eval_windows={cfg.train.eval_windows}); "
            f"set train.eval_windows={before} to keep the old eval set")


def train_data_change(saved_sampler: dict[str, Any], num_windows: int, data_seed: int) -> str | None:
    """A one-line warning when a resume continues the checkpoint's sample order on other training data
    (another number of windows: data.path changed or the folder was re-prepared) or ignores this run's
    data.seed (the checkpoint's seed keeps the order); None when it continues as the writer would have.
    Checkpoints of moe-train <= 0.5 did not store the window count: only the seed is compared."""
    notes = []
    before = saved_sampler.get("num_windows")
    if before is not None and int(before) != num_windows:
        notes.append(f"the training data has {num_windows} windows of data.seq_len, the run that wrote the "
                     f"checkpoint had {before} (data.path changed or re-prepared): sample "
                     f"{saved_sampler.get('samples_seen')} onwards is drawn from this data, not the old order")
    if int(saved_sampler.get("seed", data_seed)) != data_seed:
        notes.append(f"data.seed={data_seed} is ignored on resume: the checkpoint's sampler seed "
                     f"{saved_sampler['seed']} keeps the sample order (start a new train.run_dir for another order)")
    return "; ".join(notes) or None


def check_not_an_import(run_dir: str | Path) -> None:
    """An `import-hf` output is no run folder: training there would begin from a random init beside the imported
    weights, so it is refused, naming train.init_from, which starts a run from them."""
    run = Path(run_dir)
    if (run / "model.safetensors").is_file() and (run / "hf_extra.json").is_file():
        raise ConfigError(f"train.run_dir={run_dir} holds an import-hf output (model.safetensors, hf_extra.json), not a "
                          f"run: to train from its weights use train.init_from={run_dir} with another train.run_dir")


def check_no_checkpoints_after(run_dir: str | Path, start_step: int, resume: bool) -> None:
    """Refuse to start when a checkpoint folder past `start_step` exists: the run would train up
    to it and then fail to save over it (an incomplete folder left by hand, or --no-resume on a
    run that has checkpoints)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return
    later = sorted(p.name for p in root.iterdir() if (step := step_of(p)) is not None and step > start_step)
    if later:
        why = (f"this run resumes from step {start_step}" if resume and start_step > 0
               else "this run starts from step 0 (no resume)" if not resume else "no complete checkpoint was found")
        raise ConfigError(f"train.run_dir={run_dir}: {root}/{later[0]} exists but {why}; the run would have to "
                          f"write over {', '.join(later)}. Move those folders away or use a new train.run_dir")


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
    metadata.json and the trainer's fields in it, every shard file's size and safetensors header (checksums
    are not computed: that would read every byte of it, on every rank)."""
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
            f"{step_of(intact)}; sizes and headers checked, not checksums). To resume from it, move the damaged one "
            f"aside (mv {damaged} {aside}: moe-train ignores that name) and start the run again")


@contextlib.contextmanager
def _naming_the_way_back(path: Path) -> Iterator[None]:
    """A CheckpointError raised inside, for checkpoint `path`, gets way_back(path) added to its message (the CLI
    prints the message alone), keeping its type. A checkpoint of a newer format is not damaged: not this error."""
    try:
        yield
    except UnsupportedFormatVersionError:
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


def newest_checkpoint(path: str | Path) -> Path | None:
    """What a source path given to export-hf or train.init_from reads: the newest complete checkpoint of a run
    folder, or of a run's checkpoints/ folder given directly (as inspect takes it); None for anything else (a
    checkpoint folder itself, an import-hf output), which is read as given."""
    return latest(path) or find_latest(path)


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
    if name not in saved and weight is not None and saved.get(weight, {}).get("dtype") == "float32":
        return weight
    if one_step_count and _is_param_step(name):
        return "optim.step"
    return name  # a name the checkpoint lacks is reported by load_checkpoint


def _read(path: Path, shards: list[CheckpointShard], device: torch.device) -> dict[str, torch.Tensor]:
    """{shard name: its slice} for a resume: optimizer state too."""
    saved = inspect_checkpoint(path)["tensors"]
    one_step_count = "optim.step" in saved and not any(map(_is_param_step, saved))
    return read_regions(path, {s.global_name: (_stored_name(s.global_name, saved, one_step_count), s) for s in shards},
                        device)


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
        data = fail_together(lambda: _read(path, shards, runtime.device), runtime.rank, runtime.world_size,
                             lambda flags: runtime.all_reduce_sum(flags.to(runtime.device)).cpu(), f"loading {path}")
    runtime.load_checkpoint_shards(lambda name, _slice: data[name])
    params = {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        for s in shards:
            if s.global_name not in params and not s.global_name.startswith("optim."):
                s.tensor.copy_(data[s.global_name].reshape(s.tensor.shape))
    return load_metadata(path)
