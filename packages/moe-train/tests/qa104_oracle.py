"""QA 104's independent validity oracle for moe-train configs (written from the README and the config comments, not
by calling `validate`), the values it draws per field, and the helpers that put a draw through the public paths
(test_qa104.py runs them)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import random
import re
import typing
import warnings


from moe_train.cli import main
from moe_train.config import Config, ConfigError
from moe_train.config_io import build_config

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
