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

import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_parallel import ParallelLayout
from moe_train.config import Config, ConfigError
from moe_train.model import Transformer, count_params
from moe_train.trainer import launch
from moe_train.trainer.runtime import LocalRuntime

sys.path.insert(0, str(Path(__file__).parent))
from qa104_oracle import (  # noqa: E402
    as_text,
    as_typed,
    base_values,
    build,
    draws,
    names_a_field,
    oracle,
    run_cli,
    SMALL,
)


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
    (["--parallel.dp=2"], "parallel layout: parallel.dp=2 x parallel.pp=1 = 2 does not equal world_size=1"),
    (["--parallel.dp=2", "--parallel.ep=2"], "parallel layout: parallel.dp=2 x parallel.pp=1 = 2 does not equal world_size=1"),
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
