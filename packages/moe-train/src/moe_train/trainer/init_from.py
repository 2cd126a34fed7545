"""train.init_from: a run that starts at step 0 takes its weights from a checkpoint instead of a random init.

The source is a run folder (its latest checkpoint), a trainer checkpoint folder (any parallel layout wrote it), or
an `import-hf` output (model.safetensors + config.json: a Hugging Face model converted to ours). Weights and
persistent buffers (the routers' expert bias) come from it: fp32 masters where the checkpoint has them, so a
bf16-resident run's weights come back at full precision. Everything else starts fresh, as it does from a random
init: AdamW moments and step counts, the step, the data order, the RNG. A run that resumes its own checkpoint
never reads the source again (its weights are in that checkpoint).

The source must hold this run's network (resume_checks.model_differences), except for how far attention reads:
model.rope_theta and model.sliding_window_pattern may differ, as in a long-context stage, with a warning that names
them. A resume of that run then keeps its own values.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from moe_ckpt import CheckpointError, fail_together, inspect_checkpoint, step_of
from moe_ckpt.hf import HFConversionError
from moe_train.config import Config, ConfigError
from moe_train.trainer import checkpoint as ckpt
from moe_train.trainer import resume_checks
from moe_train.trainer.runtime import CheckpointShard, Runtime, Slice


def check_init_source(cfg: Config) -> Path:
    """The checkpoint train.init_from names, checked before the run starts (its files are read only when the
    weights are loaded): a layout we read, and weights of this run's network (rope_theta and the windows may differ:
    warn_if_another_attention_reach)."""
    # hf_bridge imports the trainer's checkpoint module: imported here, not at the top
    from moe_train.hf_bridge import hugging_face_model_type, stored_config

    given = cfg.train.init_from
    source = Path(given)  # a `~` was expanded by build_config, as in train.run_dir
    if not source.exists():
        raise ConfigError(f"train.init_from={given!r} does not exist: expected a run folder, a checkpoint folder or "
                          "an import-hf output")
    path = ckpt.newest_checkpoint(source) or source
    try:
        stored = stored_config(path)
    except (CheckpointError, HFConversionError, ConfigError) as e:
        model_type = hugging_face_model_type(path)
        if model_type is not None:  # the folder import-hf reads, given in place of what it writes
            raise ConfigError(f"train.init_from={given!r} is a Hugging Face model folder (config.json model_type="
                              f"{model_type!r}), not ours: convert it first with `moe-train import-hf {given} OUT`, "
                              "then train.init_from=OUT (and --config OUT/config.json for its model settings)") from None
        raise ConfigError(f"train.init_from={given!r}: {e}") from None
    diffs, _ = resume_checks.init_from_differences(stored.to_dict()["model"], cfg)
    if diffs:
        raise ConfigError(f"train.init_from={given!r} ({path}) holds the weights of another model ({'; '.join(diffs)}); "
                          "give this run the checkpoint's model settings (an import-hf output's config.json works as "
                          "--config)")
    return path


def warn_if_another_attention_reach(source: Path, cfg: Config) -> None:
    """A run may read the source's weights with another rope_theta or other windows (a long-context stage does, on
    purpose); say so once, naming each, so that a change made by mistake does not pass unseen."""
    from moe_train.hf_bridge import stored_config

    _, changed = resume_checks.init_from_differences(stored_config(source).to_dict()["model"], cfg)
    if changed:
        warnings.warn(f"train.init_from={str(source)!r}: this run reads its weights with other attention settings "
                      f"than they were trained with ({'; '.join(changed)})", stacklevel=2)


def warn_if_another_tokenizer(source: Path, data_dir: Path, data_tokenizer: str) -> None:
    """An import-hf output carries its model's tokenizer.json; a data folder tokenized by another one feeds the weights
    ids that stand for other text, and nothing else would tell (the output's config.json names the embedded corpus,
    whose BPE is the model's only if the model was trained on it with the same data settings)."""
    from moe_train.data import DataError
    from moe_train.data.prepare import load_tokenizer

    theirs, ours = source / "tokenizer.json", data_dir / data_tokenizer
    if not (theirs.is_file() and ours.is_file()):
        return
    try:
        same = load_tokenizer(str(theirs)).to_str() == load_tokenizer(str(ours)).to_str()
    except DataError:  # a damaged file: the weights load all the same, and its own tools say what is wrong
        return
    if not same:
        warnings.warn(f"train.init_from={str(source)!r} holds the tokenizer.json its weights were trained with, and "
                      f"the data folder {str(data_dir)!r} was tokenized by another: the model reads its token ids as "
                      f"other text; tokenize the data with the model's (moe-train prepare-data --tokenizer {theirs} "
                      "--out DIR, then --data.path=DIR)", stacklevel=3)


def load_initial_weights(path: Path, runtime: Runtime, model: nn.Module) -> None:
    """Every rank calls this: fill the weights, fp32 masters and persistent buffers this rank holds from `path`
    (check_init_source's), the optimizer state with zeros. If any rank's read fails, every rank raises."""
    _require_one_source(path, runtime)
    shards = ckpt.all_shards(runtime, model)
    weights = {s.global_name: s for s in shards
               if not s.global_name.startswith("optim.") or ckpt.master_of(s.global_name)}
    params = {name for name, _ in model.named_parameters()}

    def read() -> dict[str, torch.Tensor]:
        try:
            if (path / "index.json").is_file():  # a trainer checkpoint: each rank reads only its regions
                saved = inspect_checkpoint(path)["tensors"]
                wanted = {name: (_stored_name(name, params, saved), s) for name, s in weights.items()}
                return ckpt.read_regions(path, wanted, runtime.device)
            return _read_whole_tensors(path, weights)
        except CheckpointError as e:  # a damaged file named as the setting that chose it, its type kept
            e.args = (f"train.init_from={str(path)!r}: {e}",)
            raise

    data = fail_together(read, runtime.rank, runtime.world_size,
                         lambda flags: runtime.all_reduce_sum(flags.to(runtime.device)).cpu(),
                         f"reading train.init_from {path}")
    runtime.load_checkpoint_shards(lambda name, sl: data[name] if name in data else _zeros(sl))
    with torch.no_grad():
        for s in shards:
            if s.global_name not in params and not s.global_name.startswith("optim."):
                s.tensor.copy_(data[s.global_name].reshape(s.tensor.shape))


def _require_one_source(path: Path, runtime: Runtime) -> None:
    """Every rank resolved the same checkpoint: a run folder's latest one, looked up by each rank on its own, may
    move on between the ranks' lookups (a run still saving), and replicas starting from different weights would
    never agree again. Compared by step (one all-reduce of the step and its square)."""
    step = step_of(path)
    if not ranks_agree_on(float(step if step is not None else -1), runtime):
        raise ConfigError(f"train.init_from: the ranks resolved different checkpoints of {path.parent} (this rank: "
                          f"{path.name}; a run still saving?); give train.init_from one checkpoint folder")


def ranks_agree_on(value: float, runtime: Runtime) -> bool:
    """Whether every rank passed the same value (an integer-valued float: a step); every rank calls it. One
    all-reduce of the value, its square and a count: they agree exactly when sum(v)^2 == n * sum(v^2)."""
    total, squares, ranks = runtime.all_reduce_sum(
        torch.tensor([value, value * value, 1.0], dtype=torch.float64, device=runtime.device)).tolist()
    return squares * ranks == total * total


def _stored_name(name: str, params: set[str], saved: dict[str, dict]) -> str:
    """The saved tensor to take `name` (a weight, its master, or a buffer) from: a weight's fp32 master when the
    checkpoint has one (a bf16-resident run saves the weight in bf16), else the weight itself."""
    weight = ckpt.master_of(name) or name
    if weight in params and f"optim.{weight}.master" in saved:
        return f"optim.{weight}.master"
    return weight


def _read_whole_tensors(path: Path, weights: dict[str, CheckpointShard]) -> dict[str, torch.Tensor]:
    """An import-hf output (one model.safetensors by our names): each tensor read whole once (for the weight and
    its master alike), then copies of this rank's regions, so only one whole tensor is held at a time."""
    from moe_train.hf_bridge import open_checkpoint_source

    wanted_of: dict[str, list[tuple[str, CheckpointShard]]] = {}
    for name, s in weights.items():
        wanted_of.setdefault(ckpt.master_of(name) or name, []).append((name, s))
    out: dict[str, torch.Tensor] = {}
    with open_checkpoint_source(path) as (_, source):
        for weight, wanted in wanted_of.items():
            try:
                t = source(weight)
            except Exception as e:  # noqa: BLE001 - named below
                raise CheckpointError(f"{path}: cannot read tensor {weight!r} ({type(e).__name__}: {e})") from None
            shape = wanted[0][1].global_shape
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{path}: tensor {weight!r} has shape {list(t.shape)}, expected "
                                      f"{list(shape)} for this run's model")
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise CheckpointError(f"{path}: tensor {weight!r} holds {bad} NaN / Inf values: expected finite weights")
            t = t.float()
            for name, s in wanted:
                out[name] = _region_of(t, s.slice).clone()  # a copy: a view would keep the whole tensor alive
            del t
    return out


def _region_of(t: torch.Tensor, sl: Slice) -> torch.Tensor:
    if hasattr(sl, "start"):  # a flat range of the flattened global tensor
        return t.reshape(-1)[sl.start: sl.start + sl.length]
    return t[tuple(slice(o, o + n) for o, n in sl)]


def _zeros(sl: Slice) -> torch.Tensor:
    """Fresh optimizer state for one shard: zero moments, zero step counts."""
    if hasattr(sl, "start"):
        return torch.zeros(sl.length)
    return torch.zeros(tuple(n for _, n in sl))
