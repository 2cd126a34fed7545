"""QA 104: moe-train's config and parallel-layout checks fuzzed against an independent validity oracle.

What was tried:
- `oracle()` below restates, from the README and the config dataclasses' comments (not by calling `validate`), which
  values each field takes and which combinations are refused: positive sizes, heads / kv heads / head_dim / rotary
  fraction, experts / top_k / dense_layers / shared expert and its gate, routing options, data fields, the lr schedule
  (lr_decay_fraction only with wsd), intervals, AdamW's float32 bounds, threads, dtypes, activation checkpointing,
  compile, FSDP's restrictions, ep dividing dp and the experts, capacity, the collective timeout.
- Seeded random draws (1 to 4 fields changed from a small valid config; values include 0, 1, negatives, huge ints,
  NaN / inf, floats where ints are expected, strings, None, booleans) through `build_config` (Python values), through
  `moe-train info` in process (the same values as command-line text: exit 2 with exactly one `moe-train: error:`
  line naming a field the oracle names and its value, or exit 0 printing the config build_config gives), and a sample
  of them through `moe-train train` (refused before a run folder, a data cache or a process group exists). A sample
  of the valid ones is built as a model (its parameter count is count_params') and run forward.
- Parallel layouts at world sizes 1-8 (dp, ep, pp, experts, strategy, backend) through the trainer's
  `launch.make_runtime` with WORLD_SIZE set and `init_process_group` replaced by a sentinel (no process is spawned),
  and through `moe_parallel.ParallelLayout.validate`: a layout is refused in one line before any process group,
  exactly when the oracle says so; a valid one reaches the process group (or LocalRuntime for a plain single process).
- The refusals the Trainer makes after `validate` (a top-1 learned router renormalised, the embedded corpus's BPE
  larger than the vocabulary, a layout for another world size, NCCL on the CPU, no GPU for train.device=cuda) through
  `moe-train train`: one line, nothing written, no process group.

Defects found (each "fails before the fix" was run against `git archive HEAD`):
- `train --parallel.backend=nccl --parallel.expert_capacity_factor=1` on a CPU machine (any layout that makes a
  process group on the CPU) ended in a RuntimeError traceback from inside torch's init_process_group ("nccl2 requires
  at least one CUDA device"); now one line naming parallel.backend, before the process group (trainer/launch.py).
  Fails before the fix.
- `--parallel.strategy=fsdp --train.save_interval=0 --train.init_from=X` passed `validate` (and `info`) and was
  refused only in the resume checks, after the process group, the model and the run folder (with its `.lock`) were
  made, naming parallel.strategy; now `validate` refuses it naming train.init_from (config.py). Fails before the fix.
- `--parallel.collective_timeout_s=0.0001` (any value below 1 ms) was accepted as "a positive number of seconds",
  and the first all-to-all of the run failed with gloo's internal `enforce fail ... timeout_2.count() > 0` traceback
  (process groups count whole milliseconds); now refused below 0.001 (config.py). Fails before the fix.
- `--model.head_dim=100 --model.rotary_fraction=0.58` (or 0.14) was refused saying "this one gives 58" (14), a
  whole even number: the float product is 57.99999999999999 (14.000000000000002). Still refused (the export's and
  transformers' rotary dims are int() of the product), but the message now shows the product and says why
  (config.py). Fails before the fix.
- A WORLD_SIZE, RANK or LOCAL_RANK in the environment that is not an integer (`WORLD_SIZE=abc moe-train train`)
  was a ValueError traceback from int(); now one line naming the variable, before any process group
  (trainer/launch.py). Fails before the fix.

Noticed and left alone (see the report): a model with num_experts > 0 whose every layer is in dense_layers has no
router, yet train refuses its top_k=1 with normalize_top_k (model/router.py); a dense model (num_experts=0) takes
shared_expert_hidden / shared_expert_gate / router fields without a word and builds none of them; int fields take
any digits Python's int() reads (`--train.steps=５` is 5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import random
import re
import typing
import warnings

import pytest
import torch
import torch.distributed as dist

from moe_parallel import ParallelLayout
from moe_train.cli import main
from moe_train.config import Config, ConfigError, validate
from moe_train.config_io import build_config
from moe_train.model import Transformer, count_params
from moe_train.trainer import launch
from moe_train.trainer.runtime import LocalRuntime

F32_MAX, F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38
NAN, INF = float("nan"), float("inf")

# the values drawn for each field: valid ones and boundary / wrong-typed ones
FIELDS: dict[str, list] = {
    "model.vocab_size": [256, 512, 1000, 0, -5, 1.5, None, "512", 2**64],
    "model.d_model": [32, 48, 64, 31, 0, -32, 64.0, None, "abc"],
    "model.num_layers": [1, 2, 3, 0, -1, 70000, 2.0, None],
    "model.num_heads": [1, 2, 4, 3, 8, 0, -4, None, True],
    "model.num_kv_heads": [1, 2, 4, 3, 8, 0, -2, None],
    "model.head_dim": [None, 8, 16, 6, 7, 0, -8, 12.0, "x", 100],
    "model.rotary_fraction": [1.0, 0.5, 0.25, 0.3, 0.0, 1.5, -0.5, NAN, 0.58],
    "model.rope_theta": [10000.0, 1.0, 0.0, -1.0, INF, 1e30],
    "model.norm_eps": [1e-6, 0.0, -1e-6, 1e-30],
    "model.init_std": [0.02, 0.0, -0.02, 1.0],
    "model.dense_hidden": [64, 1, 0, -64, 96],
    "model.dense_layers": [[], [0], [1], [0, 1], [0, 0], [-1], [5], [0.0], 0, None, [1.5], [True]],
    "model.num_experts": [0, 1, 2, 4, 8, 6, -1, 2.0],
    "model.expert_hidden": [16, 1, 0, -16, 32],
    "model.shared_expert_hidden": [0, 16, -1, 8],
    "model.shared_expert_gate": [False, True, 1, "yes", 2],
    "model.qk_norm": [True, False, 0, None],
    "model.attention_bias": [True, False],
    "model.tie_embeddings": [True, False],
    "model.gemm_backend": ["auto", "torch", "reference", "cuda", None, ""],
    "model.precision": ["bf16", "fp8", 16],
    "model.router.top_k": [1, 2, 3, 4, 0, -1, 9, 2.0],
    "model.router.normalize_top_k": [True, False],
    "model.router.gating": ["softmax", "sigmoid", "relu", None],
    "model.router.routing": ["learned", "random", "uniform", "hash"],
    "model.router.lb_loss_scope": ["micro_batch", "global", "batch"],
    "model.router.lb_loss_weight": [0.0, 0.01, -0.01, INF],
    "model.router.z_loss_weight": [0.0, 0.001, -1.0],
    "model.router.expert_bias": [True, False],
    "model.router.expert_bias_rate": [0.0, 0.001, -0.001],
    "model.router.routed_scaling_factor": [1.0, 2.5, 0.0, -1.0, NAN],
    "data.seq_len": [2, 16, 32, 1, 0, -8, 32.0, 2**70],
    "data.seed": [0, 1, -1, 2**63 - 1, 2**63],
    "data.eval_fraction": [0.02, 0.5, 0.0, 1.0, -0.1, 1.5],
    "data.default_vocab_size": [512, 1, 0, -1],
    "data.default_max_bytes": [1000, 0, -1],
    "data.path": ["default", "", "some/folder"],
    "data.cache_dir": ["data", ""],
    "train.steps": [1, 2, 10, 0, -1, 2.0, 2.5, "5", None, 10**30],
    "train.micro_batch_size": [1, 2, 4, 0, -1],
    "train.grad_accum": [1, 2, 4, 0, -2],
    "train.lr": [3e-3, 1.0, 0.0, -1e-3, 1e39, INF, "1e-3"],
    "train.min_lr_ratio": [0.0, 0.1, 1.0, 1.1, -0.1],
    "train.warmup_steps": [0, 1, 5, 100, -1],
    "train.lr_schedule": ["cosine", "linear", "constant", "wsd", "step", None],
    "train.lr_decay_fraction": [0.2, 0.5, 1.0, 0.0, 1.5],
    "train.weight_decay": [0.0, 0.1, -0.1],
    "train.beta1": [0.0, 0.9, 1.0, -0.1],
    "train.beta2": [0.95, 0.999, 1.0, 1.5],
    "train.eps": [1e-8, 0.0, 1e-40, -1e-8],
    "train.grad_clip": [0.0, 1.0, -1.0],
    "train.seed": [0, 7, -1, 2**40],
    "train.eval_interval": [0, 1, 50, -1],
    "train.eval_windows": [1, 8, 0, -1],
    "train.log_interval": [1, 10, 0, -1],
    "train.save_interval": [0, 1, 100, -1],
    "train.keep_last": [1, 2, 0, -1],
    "train.max_skipped_steps": [1, 10, 0],
    "train.threads": [0, 1, 4096, 4097, -1],
    "train.device": ["auto", "cpu", "cuda", "tpu", ""],
    "train.activation_checkpointing": ["none", "full", "mlp", "attn", "~"],
    "train.compile": [False, True],
    "train.async_save": [False, True],
    "train.init_from": [None, "", "ckpt/x"],
    "train.run_dir": ["runs/x", ""],
    "parallel.dp": [1, 2, 4, 8, 3, 0, -1],
    "parallel.ep": [1, 2, 4, 8, 3, 0],
    "parallel.pp": [1, 2, 0],
    "parallel.backend": ["auto", "gloo", "nccl", "mpi"],
    "parallel.strategy": ["ddp", "fsdp", "zero3"],
    "parallel.param_dtype": ["fp32", "bf16", "fp16"],
    "parallel.distributed_optimizer": [True, False],
    "parallel.fp32_grad_accum": [True, False],
    "parallel.expert_capacity_factor": [0.0, 1.0, 1.25, 0.5, -1.0],
    "parallel.collective_timeout_s": [1800.0, 1.0, 0.001, 0.0, 0.0001, -1.0, 1e7, 1e8, INF],
}

# a small valid starting point (tiny preset's other fields), so the valid draws build in milliseconds
SMALL = {"model.vocab_size": 256, "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.dense_hidden": 64, "model.num_experts": 4, "model.expert_hidden": 16,
         "model.dense_layers": [0], "data.seq_len": 16, "data.default_vocab_size": 256}


def _field_types() -> dict[str, typing.Any]:
    out = {}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            t = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.")
            else:
                out[prefix + f.name] = t
    walk(Config, "")
    return out


TYPES = _field_types()


class Refused(Exception):
    pass


def _as_int(v):
    """An int field takes an int in 64 bits, or a whole float / numeric text small enough to be exact."""
    if isinstance(v, bool):
        raise Refused
    if isinstance(v, int):
        if not -2**63 <= v < 2**63:
            raise Refused
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 2**53:
        return int(v)
    if isinstance(v, str):
        for parse in (int, float):
            try:
                return _as_int(parse(v))
            except ValueError:
                pass
    raise Refused


def _as_field(name: str, v):
    """The value field `name` holds for the Python value v, or Refused (its type is wrong)."""
    t = TYPES[name]
    optional = type(None) in typing.get_args(t)
    base = next((a for a in typing.get_args(t) if a is not type(None)), t) if optional else t
    if v is None:
        if optional:
            return None
        raise Refused
    if typing.get_origin(base) is list:
        if not isinstance(v, list):
            raise Refused
        return [_as_int(x) for x in v]
    if base is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return v.lower() in ("true", "yes", "on", "1")
        raise Refused
    if base is int:
        return _as_int(v)
    if base is float:
        if isinstance(v, bool):
            raise Refused
        try:
            x = float(v)
        except (ValueError, TypeError, OverflowError):
            raise Refused from None
        if not math.isfinite(x):
            raise Refused
        return x
    if base is str:
        if not isinstance(v, str):
            raise Refused
        return v
    raise AssertionError(name)


def oracle(values: dict) -> set[str]:
    """The fields any of which a refusal of `values` (every field, dotted) may name; empty when the config is valid.
    "*" stands for the widest-weight bound (a product of several fields)."""
    v, errs = {}, set()
    for k, x in values.items():
        try:
            v[k] = _as_field(k, x)
        except Refused:
            errs.add(k)
    if errs:
        return errs  # a wrong type: refused before any range check

    def need(cond, *fields):
        if not cond:
            errs.update(fields)

    m, r, t, p = "model.", "model.router.", "train.", "parallel."
    for f in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "dense_hidden"):
        need(v[m + f] >= 1, m + f)
    need(v[m + "num_layers"] <= 65536, m + "num_layers")
    hd, nh, kv, d, E = (v[m + f] for f in ("head_dim", "num_heads", "num_kv_heads", "d_model", "num_experts"))
    need(hd is None or hd >= 1, m + "head_dim")
    for f in ("rope_theta", "norm_eps", "init_std"):
        need(v[m + f] > 0, m + f)
    need(0 < v[m + "rotary_fraction"] <= 1, m + "rotary_fraction")
    need(E >= 0, m + "num_experts")
    need(v[m + "shared_expert_hidden"] >= 0, m + "shared_expert_hidden")
    need(all(0 <= i < v[m + "num_layers"] for i in v[m + "dense_layers"]), m + "dense_layers")
    if nh >= 1 and kv >= 1 and d >= 1 and (hd is None or hd >= 1):
        need(nh % kv == 0, m + "num_kv_heads", m + "num_heads")
        need(hd is not None or d % nh == 0, m + "num_heads", m + "d_model", m + "head_dim")
        rhd = hd if hd is not None else d // nh
        rotary = v[m + "rotary_fraction"] * rhd  # RoPE rotates a whole even number of dims (the float product)
        need(rotary == int(rotary) and int(rotary) % 2 == 0, m + "rotary_fraction", m + "head_dim")
        widths = [v[m + "vocab_size"], nh * rhd, v[m + "dense_hidden"], v[m + "shared_expert_hidden"],
                  max(E, 0) * v[m + "expert_hidden"]]
        need(d * max(widths) <= 2**48, "*")
    if E > 0:
        need(v[m + "expert_hidden"] >= 1, m + "expert_hidden")
        need(1 <= v[r + "top_k"] <= E, r + "top_k")
    need(not v[m + "shared_expert_gate"] or v[m + "shared_expert_hidden"] > 0, m + "shared_expert_gate")
    need(v[r + "gating"] in ("softmax", "sigmoid"), r + "gating")
    need(v[r + "routing"] in ("learned", "random", "uniform"), r + "routing")
    need(v[r + "lb_loss_scope"] in ("micro_batch", "global"), r + "lb_loss_scope")
    for f in ("lb_loss_weight", "z_loss_weight", "expert_bias_rate"):
        need(v[r + f] >= 0, r + f)
    need(v[r + "routed_scaling_factor"] > 0, r + "routed_scaling_factor")
    need(v[m + "gemm_backend"] in ("auto", "torch", "reference", "triton"), m + "gemm_backend")
    need(v[m + "precision"] == "bf16", m + "precision")
    for f in ("data.path", "data.cache_dir", "train.run_dir", "train.init_from"):
        need(v[f] != "", f)
    need(v["data.seq_len"] >= 2, "data.seq_len")
    need(v["data.seed"] >= 0, "data.seed")
    need(v["data.default_vocab_size"] >= 1, "data.default_vocab_size")
    need(v["data.default_max_bytes"] >= 1, "data.default_max_bytes")
    need(0 < v["data.eval_fraction"] < 1, "data.eval_fraction")
    for f in ("steps", "micro_batch_size", "grad_accum", "eval_windows", "log_interval", "keep_last",
              "max_skipped_steps"):
        need(v[t + f] >= 1, t + f)
    need(0 < v[t + "lr"] <= F32_MAX, t + "lr")
    need(0 <= v[t + "min_lr_ratio"] <= 1, t + "min_lr_ratio")
    need(v[t + "warmup_steps"] >= 0, t + "warmup_steps")
    need(v[t + "lr_schedule"] in ("cosine", "linear", "constant", "wsd"), t + "lr_schedule")
    need(0 < v[t + "lr_decay_fraction"] <= 1, t + "lr_decay_fraction")
    need(v[t + "lr_schedule"] == "wsd" or v[t + "lr_decay_fraction"] == 0.2, t + "lr_decay_fraction")
    for f in ("eval_interval", "save_interval", "grad_clip", "weight_decay"):
        need(v[t + f] >= 0, t + f)
    for f in ("beta1", "beta2"):
        need(0 <= v[t + f] < 1, t + f)
    need(v[t + "eps"] >= F32_TINY, t + "eps")
    need(v[t + "seed"] >= 0, t + "seed")
    need(0 <= v[t + "threads"] <= 4096, t + "threads")
    need(v[t + "device"] in ("auto", "cpu", "cuda"), t + "device")
    need(v[t + "activation_checkpointing"] in ("none", "full", "mlp"), t + "activation_checkpointing")
    for f in ("dp", "ep", "pp"):
        need(v[p + f] >= 1, p + f)
    need(v[p + "pp"] == 1, p + "pp")  # pipeline parallelism is not built
    need(v[p + "backend"] in ("auto", "gloo", "nccl"), p + "backend")
    need(v[p + "strategy"] in ("ddp", "fsdp"), p + "strategy")
    need(v[p + "param_dtype"] in ("fp32", "bf16"), p + "param_dtype")
    # a timeout counted in whole milliseconds, within what datetime holds
    need(0.001 <= v[p + "collective_timeout_s"] <= 1e7, p + "collective_timeout_s")
    need(v[p + "expert_capacity_factor"] == 0 or v[p + "expert_capacity_factor"] >= 1, p + "expert_capacity_factor")
    if v[p + "strategy"] == "fsdp":  # the FSDP2 baseline: eager, dense sharding, no checkpoints, fp32 weights
        need(not v[t + "compile"], t + "compile")
        need(v[t + "save_interval"] == 0, t + "save_interval")
        need(v[p + "ep"] == 1, p + "ep")
        need(v[p + "param_dtype"] == "fp32", p + "param_dtype")
        need(v[t + "init_from"] is None, t + "init_from")
    if v[p + "ep"] >= 1 and v[p + "dp"] >= 1 and v[p + "ep"] > 1:
        need(v[p + "dp"] % v[p + "ep"] == 0, p + "ep")
        need(E > 0 and E % v[p + "ep"] == 0, p + "ep")
    return errs


def _get(cfg: Config, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def base_values() -> dict:
    cfg = build_config("tiny")
    return {**{k: _get(cfg, k) for k in FIELDS}, **SMALL}


def draws(seed: int, n: int):
    """n seeded draws of (all values, the overrides that give them): 1 to 4 fields changed from SMALL."""
    rng, base = random.Random(seed), base_values()
    for _ in range(n):
        values, overrides = dict(base), dict(SMALL)
        for k in rng.sample(sorted(FIELDS), rng.randint(1, 4)):
            overrides[k] = values[k] = rng.choice(FIELDS[k])
        yield values, overrides


def as_text(v) -> str:
    """A Python value as typed on the command line (a YAML scalar or flow list)."""
    if v is None:
        return "~"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(as_text(x) for x in v) + "]"
    return repr(v) if isinstance(v, float) else str(v)


def as_typed(values: dict) -> dict:
    """values as the command line gives them: a string field takes the text as typed (`--model.precision=16` is
    the string "16", refused as no precision, not as a number)."""
    return {k: as_text(v) if TYPES[k] is str and v is not None else v for k, v in values.items()}


def names_a_field(message: str, fields: set[str]) -> bool:
    """The message names one of `fields` with its value (`field=value`, the override `--field=text`, or
    `field: YAML read 16 as the number 16`); any field for the widest-weight bound."""
    return "*" in fields or any(re.search(re.escape(f) + r"(\[\])?[=:]", message) for f in fields)


def build(overrides: dict) -> Config | str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build_config("tiny", overrides=overrides)
    except ConfigError as e:
        return str(e)


def run_cli(argv: list[str]) -> tuple[int, str, list[str]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue().strip().splitlines()


def test_the_oracle_refuses_what_the_readme_refuses():
    """The oracle itself can say no: the README's own example, and a valid small config."""
    base = base_values()
    assert oracle(base) == set()
    assert oracle({**base, "model.router.top_k": 9, "model.num_experts": 8}) == {"model.router.top_k"}
    assert oracle({**base, "parallel.collective_timeout_s": 0.0001}) == {"parallel.collective_timeout_s"}


def test_random_configs_through_build_config_agree_with_the_oracle():
    mismatches = []
    for values, overrides in draws(seed=104, n=200):
        expected, got = oracle(values), build(overrides)
        valid = isinstance(got, Config)
        if valid != (not expected) or (not valid and not names_a_field(got, expected)):
            mismatches.append((overrides, sorted(expected), got if not valid else "accepted"))
    assert not mismatches, mismatches[:5]


def test_random_overrides_on_the_command_line_give_one_line_or_the_config(tmp_path):
    mismatches = []
    for values, overrides in draws(seed=1041, n=50):
        expected = oracle(as_typed(values))
        rc, out, err = run_cli(["info"] + [f"--{k}={as_text(v)}" for k, v in overrides.items()])
        if rc == 2:
            ok = bool(expected) and len(err) == 1 and err[0].startswith("moe-train: error: ") and not out \
                and names_a_field(err[0], expected)
        else:
            ok = rc == 0 and not expected and json.loads(out)["config"] == build(overrides).to_dict()
        if not ok:
            mismatches.append((overrides, sorted(expected), rc, err[:3]))
    assert not mismatches, mismatches[:5]


def test_refused_draws_through_train_write_nothing_and_make_no_process_group(tmp_path):
    refused = [o for v, o in draws(seed=1042, n=100) if oracle(as_typed(v))][:6]
    assert len(refused) == 6
    for i, overrides in enumerate(refused):
        run_dir, cache = tmp_path / f"run{i}", tmp_path / f"cache{i}"
        overrides = {**overrides, "train.run_dir": str(run_dir), "data.cache_dir": str(cache)}
        rc, out, err = run_cli(["train"] + [f"--{k}={as_text(v)}" for k, v in overrides.items()])
        assert rc == 2 and len(err) == 1 and err[0].startswith("moe-train: error: "), (overrides, rc, err)
        assert not run_dir.exists() and not cache.exists() and not dist.is_initialized(), overrides


def test_a_sample_of_valid_draws_builds_and_runs_forward():
    valid = [o for v, o in draws(seed=1043, n=300) if not oracle(as_typed(v)) and not oracle(v)]
    rng = random.Random(1043)
    for overrides in rng.sample(valid, 5):
        cfg = build(overrides)
        assert isinstance(cfg, Config), (overrides, cfg)
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        assert sum(q.numel() for q in model.parameters()) == count_params(cfg.model).total, overrides
        tokens = torch.randint(0, cfg.model.vocab_size, (1, 8))
        logits, aux = model(tokens)
        assert logits.shape == (1, 8, cfg.model.vocab_size) and torch.isfinite(logits).all(), overrides
        rc, out, err = run_cli(["info"] + [f"--{k}={as_text(v)}" for k, v in overrides.items()])
        assert rc == 0 and json.loads(out)["params_total"] == count_params(cfg.model).total, (overrides, err)


class _ProcessGroupReached(Exception):
    pass


def layout_result(monkeypatch, cfg: Config, world: int) -> str:
    """What make_runtime does for cfg at `world` ranks, without making a process group: "local", "group" (it got
    as far as making one: the layout was accepted) or the refusal's message."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")

    def reached(*args, **kwargs):
        raise _ProcessGroupReached

    monkeypatch.setattr(dist, "init_process_group", reached)
    try:
        rt = launch.make_runtime(cfg, torch.device("cpu"))
    except _ProcessGroupReached:
        return "group"
    except ConfigError as e:
        return str(e)
    assert isinstance(rt, LocalRuntime)
    return "local"


def test_layouts_at_world_sizes_1_to_8_are_refused_exactly_when_the_oracle_says(monkeypatch):
    rng = random.Random(1044)
    base = base_values()
    mismatches = []
    outcomes = set()
    for i in range(120):
        world = i + 1 if i < 8 else rng.randint(1, 8)  # first one layout that fits each world size, then any
        values = {**base, "parallel.dp": world if i < 8 else rng.choice([1, 2, 3, 4, 6, 8, world, world]),
                  "parallel.ep": rng.choice([1, 1, 2, 3, 4, 8]), "model.num_experts": rng.choice([0, 2, 4, 6, 8]),
                  "parallel.pp": rng.choice([1, 1, 1, 2]),
                  "parallel.strategy": rng.choice(["ddp", "ddp", "fsdp"]),
                  "parallel.backend": rng.choice(["auto", "gloo", "nccl"]),
                  "parallel.expert_capacity_factor": rng.choice([0.0, 0.0, 1.5])}
        if i < 8:
            values.update({"parallel.ep": 1, "parallel.pp": 1, "parallel.strategy": "ddp", "parallel.backend": "auto",
                           "parallel.expert_capacity_factor": 0.0})
        values.update({"train.save_interval": 0, "model.router.top_k": 1, "model.router.normalize_top_k": False})
        overrides = {k: values[k] for k in values if k.startswith("parallel.") or k in SMALL
                     or k in ("train.save_interval", "model.router.top_k", "model.router.normalize_top_k")}
        expected = oracle(values)
        cfg = build(overrides)
        if not isinstance(cfg, Config):  # a config refused on its own: the oracle must say so
            if not expected or not names_a_field(cfg, expected):
                mismatches.append((overrides, sorted(expected), cfg))
            continue
        p = cfg.parallel
        plain = (p.dp, p.ep, p.strategy, p.expert_capacity_factor) == (1, 1, "ddp", 0.0) and p.param_dtype == "fp32"
        fits = p.dp == world  # pp is 1: dp x pp must be the number of processes
        result = layout_result(monkeypatch, cfg, world)
        outcomes.add(result if result in ("local", "group") else result.split(":")[0])
        if not fits:
            ok = "\n" not in result and f"dp={p.dp}" in result and f"world_size={world}" in result
        elif world == 1 and plain:
            ok = result == "local"
        elif p.backend == "nccl":  # a process group on this machine's CPU (the test skips none: no GPU is used)
            ok = result.startswith("parallel.backend='nccl': expected 'gloo' or 'auto' on the cpu")
        else:
            ok = result == "group"
        # the layout check itself, as the trainer calls it
        try:
            ParallelLayout(p.dp, p.ep, p.pp).validate(world, cfg.model.num_experts)
            layout_ok = True
        except ValueError:
            layout_ok = False
        ok = ok and layout_ok == fits and not dist.is_initialized()
        if not ok:
            mismatches.append((overrides, world, result))
    assert not mismatches, mismatches[:5]
    assert outcomes == {"local", "group", "parallel layout", "parallel.backend='nccl'"}, outcomes  # each was reached


def test_every_small_layout_is_taken_by_parallel_layout_exactly_when_it_fits():
    """moe_parallel's check alone, pipeline stages included (the config refuses pp > 1 before it): dp x pp is the
    world size, ep divides dp and the experts; a refusal is one line naming the value that is wrong."""
    mismatches = []
    for world in range(1, 9):
        for dp in range(1, 9):
            for ep in range(1, 9):
                for pp in range(1, 5):
                    for experts in (0, 1, 2, 4, 6, 8):
                        fits = dp * pp == world and dp % ep == 0 and (ep == 1 or (experts > 0 and experts % ep == 0))
                        try:
                            ParallelLayout(dp, ep, pp).validate(world, experts)
                            message = None
                        except ValueError as e:
                            message = str(e)
                        if fits != (message is None) or (message is not None and (
                                "\n" in message or not message.startswith("parallel layout: ")
                                or not re.search(rf"(dp={dp}|ep={ep}|pp={pp}|world_size={world})\b", message))):
                            mismatches.append((world, dp, ep, pp, experts, message))
    assert not mismatches, mismatches[:5]


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL on a CUDA machine is a valid choice")
def test_nccl_on_the_cpu_is_one_line_naming_parallel_backend_before_any_process_group(tmp_path):
    run_dir = tmp_path / "run"
    rc, out, err = run_cli(["train", "--parallel.backend=nccl", "--parallel.expert_capacity_factor=1",
                            f"--train.run_dir={run_dir}", f"--data.cache_dir={tmp_path / 'cache'}"])
    assert rc == 2 and len(err) == 1, err[-3:]
    assert err[0].startswith("moe-train: error: parallel.backend='nccl': expected 'gloo' or 'auto' on the cpu"), err
    assert not run_dir.exists() and not (tmp_path / "cache").exists() and not dist.is_initialized()


def test_fsdp_with_init_from_is_refused_by_the_config_naming_train_init_from(tmp_path):
    argv = ["--parallel.strategy=fsdp", "--train.save_interval=0", f"--train.init_from={tmp_path}"]
    rc, out, err = run_cli(["info"] + argv)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"moe-train: error: train.init_from={str(tmp_path)!r}: expected null with "
                             "parallel.strategy='fsdp'"), err
    run_dir = tmp_path / "run"
    rc, out, err = run_cli(["train"] + argv + [f"--train.run_dir={run_dir}", f"--data.cache_dir={tmp_path / 'c'}"])
    assert rc == 2 and len(err) == 1 and "train.init_from=" in err[0] and not run_dir.exists(), err


def test_a_collective_timeout_below_a_millisecond_is_refused_and_one_millisecond_works():
    got = build({"parallel.collective_timeout_s": "0.0001"})
    assert isinstance(got, str) and got.startswith("parallel.collective_timeout_s=0.0001: expected a positive "
                                                   "number of seconds <= 1e7"), got
    assert ">= 0.001" in got, got
    cfg = build({"parallel.collective_timeout_s": "0.001"})
    assert isinstance(cfg, Config)
    # the smallest timeout the config takes is one gloo runs an all-to-all under (0.0001 s failed its enforce)
    from datetime import timedelta

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=cfg.parallel.collective_timeout_s))
    try:
        out = torch.empty(4)
        dist.all_to_all_single(out, torch.arange(4.0))
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fraction, product", [(0.58, "57.99999999999999"), (0.14, "14.000000000000002")])
def test_a_rotary_fraction_refused_for_float_round_off_says_so(fraction, product):
    got = build({"model.head_dim": "100", "model.rotary_fraction": str(fraction)})
    assert isinstance(got, str) and got.startswith(f"model.rotary_fraction={fraction}: "), got
    assert f"this one gives {product} in floating point, not exactly {round(float(product))}" in got, got
    assert isinstance(build({"model.head_dim": "100", "model.rotary_fraction": "0.5"}), Config)  # 50 dims


TRAINER_REFUSALS = [  # valid configs that train refuses before any work, and what its line names
    (["--model.router.top_k=1"], "model.router.normalize_top_k=true with model.router.top_k=1"),
    (["--data.default_vocab_size=4096", "--model.vocab_size=1024"], "data.default_vocab_size=4096"),
    (["--parallel.dp=2"], "parallel layout: dp=2 x pp=1 = 2 does not equal world_size=1"),
    (["--parallel.dp=2", "--parallel.ep=2"], "parallel layout: dp=2 x pp=1 = 2 does not equal world_size=1"),
]
if not torch.cuda.is_available():
    TRAINER_REFUSALS.append((["--train.device=cuda"], "train.device='cuda': expected a visible CUDA GPU"))


@pytest.mark.parametrize("argv, message", TRAINER_REFUSALS)
def test_what_train_refuses_after_validate_is_one_line_before_any_work(tmp_path, monkeypatch, argv, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert isinstance(build(dict(a[2:].split("=", 1) for a in argv)), Config)  # validate takes it
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    rc, out, err = run_cli(["train", *argv, f"--train.run_dir={run_dir}", f"--data.cache_dir={cache}"])
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"moe-train: error: {message}"), err[-3:]
    assert not run_dir.exists() and not cache.exists() and not dist.is_initialized()


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK"])
def test_a_launcher_variable_that_is_no_integer_is_one_line_naming_it(tmp_path, monkeypatch, name):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(name, "abc")
    run_dir = tmp_path / "run"
    rc, out, err = run_cli(["train", "--parallel.expert_capacity_factor=1", f"--train.run_dir={run_dir}",
                            f"--data.cache_dir={tmp_path / 'cache'}"])
    assert rc == 2 and err == [f"moe-train: error: {name}='abc' in the environment: expected an integer (torchrun "
                               "sets it; unset it to run one process)"], err[-3:]
    assert not run_dir.exists() and not dist.is_initialized()
