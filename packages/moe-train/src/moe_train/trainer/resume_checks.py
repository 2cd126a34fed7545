"""What a resume checks before any tensor is loaded: the checkpoint holds the network this run builds
(check_same_model; checkpoint.check_trainer_metadata checks the fields restore reads), the run is not past it,
and no later step folder is in the way; and the one-line warnings when a resume changes its data or eval set."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from moe_ckpt import load_metadata, step_of
from moe_ckpt.hf.windows import pattern_of
from moe_train.config import EXPERT_ONLY_FIELDS, Config, ConfigError, ModelConfig
from moe_train.data.token_file import identity_text, other_tokens
from moe_train.trainer.checkpoint import checkpoint_root, entries_after_step


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


MOE_ONLY_FIELDS = tuple(f"model.{name}" for name in EXPERT_ONLY_FIELDS)


def _network(model: dict[str, Any]) -> dict[str, Any]:
    """Flat model fields as the network they give: head_dim null is d_model // num_heads, dense_layers a
    set (order and repeats do not change which layers are dense), sliding_window_pattern its layers' windows, and a
    dense model (num_experts 0) without the fields only MoE layers read (an HF round trip resets them)."""
    out = dict(model)
    if out.get("model.num_experts") == 0:
        out = {k: v for k, v in out.items() if k not in MOE_ONLY_FIELDS and not k.startswith("model.router.")}
    d, heads = out.get("model.d_model"), out.get("model.num_heads")
    if out.get("model.head_dim") is None and isinstance(d, int) and isinstance(heads, int) and heads > 0:
        out["model.head_dim"] = d // heads
    dense = out.get("model.dense_layers")
    if isinstance(dense, list) and all(isinstance(i, int) for i in dense):
        out["model.dense_layers"] = sorted(set(dense))
    # sliding_window_pattern as the shortest cycle of the windows its layers get: [8, 0] and [8, 0, 8, 0] on 4 layers
    # (import-hf writes the former), [] and [0], are one network
    pattern, layers = out.get("model.sliding_window_pattern"), out.get("model.num_layers")
    if (isinstance(pattern, list) and all(isinstance(w, int) for w in pattern) and isinstance(layers, int)
            and layers > 0):
        out["model.sliding_window_pattern"] = pattern_of([pattern[i % len(pattern)] if pattern else 0
                                                          for i in range(layers)])
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


# Model fields a new run that starts from another run's weights (train.init_from) may change, and a resume may not:
# how far and at which frequencies attention reads, not which tensors exist or what they hold. A long-context stage
# raises rope_theta, or adds or drops windows; the weights then meet positions they were not trained on.
ATTENTION_REACH_FIELDS = frozenset({"model.rope_theta", "model.sliding_window_pattern"})


def model_differences(saved: dict[str, Any], cfg: Config) -> list[str]:
    """The network fields where a checkpoint's model section (`saved`) and cfg's differ, one "field: checkpoint
    X, this run Y" each, sorted by field; training-only fields may differ."""
    saved_model, want_model = _flat(saved, "model."), _flat(cfg.to_dict()["model"], "model.")
    defaults = _flat(dataclasses.asdict(ModelConfig()), "model.") if saved_model else {}
    saved_net = _network({**{k: v for k, v in defaults.items() if k in want_model}, **saved_model})
    want_net = _network(want_model)
    may_change = TRAINING_ONLY_MODEL_FIELDS | _top_1_renormalisation_dropped(saved_net, want_net)
    return [f"{k}: checkpoint {_as_given(saved_model, saved_net, k)}, this run {_as_given(want_model, want_net, k)}"
            for k, v in sorted(saved_net.items()) if k not in may_change and want_net.get(k) != v]


def init_from_differences(saved: dict[str, Any], cfg: Config) -> tuple[list[str], list[str]]:
    """model_differences split for train.init_from: (those that refuse the source, the ATTENTION_REACH_FIELDS ones
    it takes with a warning)."""
    diffs = model_differences(saved, cfg)
    reach = [d for d in diffs if d.split(":")[0] in ATTENTION_REACH_FIELDS]
    return [d for d in diffs if d not in reach], reach


def check_same_model(path: Path, cfg: Config) -> None:
    """Refuse to resume a checkpoint written for another model or sequence length: tensors of
    the same shapes would load silently into a different network (fewer layers, tied
    embeddings, another router). Fields are compared as the network they give (_network); a
    field the checkpoint's config predates is taken at its default, what its writer computed."""
    meta = load_metadata(path)
    saved = meta.get("config", {})
    diffs = model_differences(saved.get("model", {}), cfg)
    # the sampler's position counts windows of its seq_len (check_trainer_metadata: always there)
    saved_seq = saved.get("data", {}).get("seq_len", meta.get("sampler", {}).get("seq_len"))
    if saved_seq is not None and saved_seq != cfg.data.seq_len:
        diffs.append(f"data.seq_len: checkpoint {saved_seq}, this run {cfg.data.seq_len}")
    if diffs:
        raise ConfigError(f"{path} was written for another configuration ({'; '.join(diffs)}); "
                          "use the checkpoint's settings or a new train.run_dir")


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


def global_batch_change(saved: dict[str, Any], saved_layout: dict[str, Any], cfg: Config, step: int) -> str | None:
    """A one-line warning when this run, resumed at `step`, takes another number of sequences per optimizer step
    than the run that wrote the checkpoint (saved: its stored config; saved_layout: its layout record), as a batch
    ramp does on purpose and a changed micro-batch, grad_accum or dp does by accident; None when it is the same.
    The lr schedule goes on by step either way."""
    t = saved.get("train", {})
    try:
        before = int(t["micro_batch_size"]) * int(t["grad_accum"]) * int(saved_layout["dp"])
    except (KeyError, TypeError, ValueError):
        return None  # a checkpoint that does not record them: nothing to compare
    now = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.parallel.dp
    if before == now:
        return None
    return (f"the global batch changes at step {step}: {now} sequences per step now (train.micro_batch_size="
            f"{cfg.train.micro_batch_size} x train.grad_accum={cfg.train.grad_accum} x parallel.dp={cfg.parallel.dp}), "
            f"{before} in the run that wrote the checkpoint; each step from here trains on {now * cfg.data.seq_len:,} "
            "tokens, and the lr schedule goes on by step (train.steps and train.warmup_steps count steps, not tokens)")


def train_seed_change(before: int, cfg: Config) -> str | None:
    """A one-line warning when this run's train.seed differs from `before`, the seed the resumed run's step 0 was
    seeded with: the seed is read at step 0 only (the init, then every random draw), and a resume goes on from the
    checkpoint's RNG state, so the new seed changes nothing; None when it is the same."""
    if before == cfg.train.seed:
        return None
    return (f"train.seed={cfg.train.seed} is ignored on resume: the run goes on from the checkpoint's random state "
            f"(seeded with train.seed={before} at step 0); start a new train.run_dir for another seed")


def train_data_change(saved: dict[str, Any], num_windows: int, data: dict[str, Any], data_path: str | Path,
                      data_seed: int) -> str | None:
    """A one-line warning when a resume continues the checkpoint's sample order on other training data than the
    run that wrote it (saved: its metadata) trained on, or ignores this run's data.seed (the checkpoint's seed
    keeps the order); None when it continues as the writer would have.

    Other data: another digest of the train split's token file (data: this run's split_identity; the folder was
    re-prepared from other text or with a tokenizer that gives other ids), another token count where a folder
    prepared before digests has none, or another number of windows. Only token ids count: a tokenizer.json
    changed without changing them trains the same. Checkpoints saved before the trainer recorded its data
    (`train_data`) are compared by window count alone, those of moe-train <= 0.5 by the seed alone."""
    notes, sampler = [], saved["sampler"]
    before = sampler.get("num_windows")
    differs = []
    if other_tokens(saved.get("train_data"), data):
        differs.append(f"its train split is {identity_text(data)}, the checkpoint's was "
                       f"{identity_text(saved['train_data'])}")
    if before is not None and int(before) != num_windows:
        differs.append(f"the training data has {num_windows} windows of data.seq_len, the run that wrote the "
                       f"checkpoint had {before}")
    if differs:
        notes.append(f"data.path={str(data_path)!r} is not the training data the checkpoint was trained on "
                     f"({'; '.join(differs)}; data.path changed or re-prepared): the sample order goes on from "
                     f"sample {sampler.get('samples_seen')} over this data's windows, not the old data's")
    if int(sampler.get("seed", data_seed)) != data_seed:
        notes.append(f"data.seed={data_seed} is ignored on resume: the checkpoint's sampler seed "
                     f"{sampler['seed']} keeps the sample order (start a new train.run_dir for another order)")
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
    later = [p.name for p in entries_after_step(root, start_step)]
    if later:
        why = (f"this run resumes from step {start_step}" if resume and start_step > 0
               else "this run starts from step 0 (no resume)" if not resume else "no complete checkpoint was found")
        raise ConfigError(f"train.run_dir={run_dir}: {root}/{later[0]} exists but {why}; its checkpoints would go "
                          f"among {', '.join(later)} (a save at one of those steps fails, as the folder exists, after the "
                          "steps before it are trained; train.keep_last, which keeps the highest step numbers, would "
                          "delete this run's own saves first). Move those folders away or use a new train.run_dir")
