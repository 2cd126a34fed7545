"""QA 128: no config field is silently ignored.

Every field of Config (found with dataclasses.fields, so a field added later without an entry in EFFECTS fails
`test_every_config_field_has_an_effect_check`) is changed alone, from a small valid CPU config, to another valid
value, and what its documentation says it changes is checked: the parameters, the forward, the router's choices
and weights, the loss, the optimizer's settings and state, the lr, the files and metrics written, the threads.
Where a field acts only in combination, the combination is set; where the docs say it has no effect, the warning
or refusal is checked. GPU-only fields check the CPU's documented no-op or refusal.

Defects found and fixed (trainer/start_warnings.py): set away from their defaults where the run never reads them,
these ran without a word: train.min_lr_ratio with lr_schedule=constant, model.router.expert_bias_rate without
expert_bias, parallel.fp32_grad_accum=false with fp32 weights, parallel.distributed_optimizer=false at dp=1,
parallel.backend on a single process (no process group). Each now warns at the start, naming the field.

The registry and what the checks share are in qa128_effects.py; the checks of the model fields in
qa128_model_checks.py, of the data and train fields in qa128_run_checks.py; the parallel fields' and the audit here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import qa128_model_checks  # noqa: F401  (registers the model fields' checks)
import qa128_run_checks  # noqa: F401  (registers the data and train fields' checks)
import qa128_worker as w
import test_parallel_harness as h
from moe_train.config import ConfigError
from moe_train.trainer import launch
from moe_train.trainer.loop import Trainer
from moe_train.trainer.start_warnings import warn_about_settings
from qa128_effects import Ctx, EFFECTS, effect, leaf_fields, model, warned, world1


# ---- parallel ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, _prepared_data):
    root = tmp_path_factory.mktemp("qa128ranks")
    base = Ctx(root, _prepared_data).cfg()
    h.start_ranks(h.run_guarded, args=(w.probe, str(root), h.free_port(), base), nprocs=2)
    return h.load_results(root, 2)


@effect("parallel.dp", "parallel.ep", "parallel.distributed_optimizer", "parallel.expert_capacity_factor",
        what="gloo ranks: dp shards the optimizer (unless distributed_optimizer=false), ep splits the experts, "
             "a capacity drops rows; at dp=1 a larger layout is refused, and the unread fields warned about")
def check_layout(ctx: Ctx, name: str, two_ranks, monkeypatch) -> None:
    r = two_ranks[0]
    if name == "parallel.dp":
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        with pytest.raises(ConfigError, match=r"parallel\.dp=2 x parallel\.pp=1 = 2 does not equal world_size=1"):
            launch.make_runtime(ctx.cfg(**{name: 2}), torch.device("cpu"))
        assert r["dp2"]["lb_group"]
    elif name == "parallel.ep":
        assert (r["dp2"]["local_experts"], r["ep2"]["local_experts"]) == (4, 2)
    elif name == "parallel.distributed_optimizer":
        assert r["dp2_no_distributed_optimizer"]["master_numel"] > 1.9 * r["dp2"]["master_numel"]
        cfg = ctx.cfg(**{name: False})
        assert f"{name}=false (parallel.dp=1" in warned(lambda: warn_about_settings(cfg, torch.device("cpu")))
    else:
        assert r["ep2"]["dropped"] == 0 and r["ep2_capacity"]["dropped"] > 0
        cfg = ctx.cfg(**{name: 1.5})
        assert "drops nothing with parallel.ep=1" in warned(lambda: warn_about_settings(cfg, torch.device("cpu")))


@effect("parallel.pp", what="refused: pipeline parallelism is not built")
def check_pp(ctx: Ctx, name: str) -> None:
    with pytest.raises(ConfigError, match=r"parallel\.pp=2: expected 1"):
        ctx.cfg(**{name: 2})


@effect("parallel.param_dtype", "parallel.fp32_grad_accum",
        what="the resident weights' dtype; the gradient buffers' dtype (bf16 weights), warned as unread with fp32")
def check_dtypes(ctx: Ctx, name: str) -> None:
    for accum in (True, False):
        with world1(ctx.cfg(**{"parallel.param_dtype": "bf16", "parallel.fp32_grad_accum": accum})) as d:
            assert {p.dtype for p in d.model.parameters()} == {torch.bfloat16}
            assert {f.grad_buffer.dtype for f in d.rt.sync.flats} == {torch.float32 if accum else torch.bfloat16}
    assert {p.dtype for p in model(ctx.cfg()).parameters()} == {torch.float32}
    cfg = ctx.cfg(**{"parallel.fp32_grad_accum": False})
    assert "parallel.fp32_grad_accum=false" in warned(lambda: warn_about_settings(cfg, torch.device("cpu")))


@effect("parallel.backend", "parallel.collective_timeout_s", "parallel.strategy",
        what="the process group's backend and timeout; the FSDP2 baseline; nccl refused on the CPU")
def check_process_group(ctx: Ctx, name: str, monkeypatch) -> None:
    seen = {}
    real_init, real_groups = launch.dist.init_process_group, launch.build_groups
    monkeypatch.setattr(launch.dist, "init_process_group",
                        lambda backend, **kw: seen.update(backend=backend, timeout=kw["timeout"]) or real_init(backend, **kw))
    monkeypatch.setattr(launch, "build_groups", lambda *a, timeout: seen.update(groups=timeout) or real_groups(*a, timeout=timeout))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    value = {"parallel.backend": "gloo", "parallel.collective_timeout_s": 12.5, "parallel.strategy": "fsdp"}[name]
    with world1(ctx.cfg(**{"parallel.param_dtype": "fp32", "parallel.strategy": "fsdp", name: value})) as d:
        assert seen["backend"] == "gloo" and d.rt.torch_optimizer is not None
        if name == "parallel.collective_timeout_s":
            assert seen["timeout"].total_seconds() == seen["groups"].total_seconds() == 12.5
    if name == "parallel.backend":
        with pytest.raises(ConfigError, match="parallel.backend='nccl': expected 'gloo' or 'auto' on the cpu"):
            launch.make_runtime(ctx.cfg(**{name: "nccl", "parallel.param_dtype": "bf16"}), torch.device("cpu"))
        cfg = ctx.cfg(**{name: "nccl"})  # one process: no process group to use it
        text = warned(lambda: warn_about_settings(cfg, torch.device("cpu"), one_process=True))
        assert "parallel.backend='nccl'" in text
    if name == "parallel.strategy":
        with world1(ctx.cfg(**{"parallel.param_dtype": "bf16"})) as d:
            assert d.rt.torch_optimizer is None and d.rt.optimizer is not None


@effect("preset", what="the name recorded with the run's config; the routing warning names it")
def check_preset(ctx: Ctx, name: str) -> None:
    cfg = ctx.cfg(**{"preset": "olmo3-bench-e8", "model.router.routing": "random"})
    assert "(preset olmo3-bench-e8 sets it)" in warned(lambda: warn_about_settings(cfg, torch.device("cpu")))
    cfg.model.router.routing = "learned"
    trainer = Trainer(cfg)
    assert trainer._metadata()["config"]["preset"] == "olmo3-bench-e8"
    trainer.runtime.close()
    trainer._release_run_dir()


# ---- the audit --------------------------------------------------------------------------------------------------

def test_every_config_field_has_an_effect_check():
    fields = leaf_fields()
    assert len(fields) > 60
    assert sorted(set(fields) - set(EFFECTS)) == [], "a config field without an entry in EFFECTS"
    assert sorted(set(EFFECTS) - set(fields)) == [], "an EFFECTS entry for a field that does not exist"


@pytest.mark.parametrize("name", leaf_fields())
def test_changing_the_field_alone_changes_what_its_documentation_says(name, tmp_path, _prepared_data, request):
    if name not in EFFECTS:
        pytest.fail(f"{name}: no entry in EFFECTS")
    _, fn = EFFECTS[name]
    extra = [p for p in fn.__code__.co_varnames[2:fn.__code__.co_argcount]]
    fn(Ctx(tmp_path, _prepared_data), name, *(request.getfixturevalue(p) for p in extra))


def test_unread_settings_warn_once_naming_each_field(tmp_path, _prepared_data):
    """The defects: each of these ran without a word (their values change nothing on this run)."""
    ctx = Ctx(tmp_path, _prepared_data)
    cfg = ctx.cfg(**{"train.lr_schedule": "constant", "train.min_lr_ratio": 0.5, "model.router.expert_bias": False,
                     "model.router.expert_bias_rate": 0.25, "parallel.fp32_grad_accum": False,
                     "parallel.distributed_optimizer": False, "parallel.backend": "gloo"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(cfg)
    trainer.runtime.close()
    trainer._release_run_dir()
    texts = [str(c.message) for c in caught if "no effect on this run" in str(c.message)]
    assert len(texts) == 1, [str(c.message) for c in caught]
    for field in ("train.min_lr_ratio=0.5", "model.router.expert_bias_rate=0.25", "parallel.fp32_grad_accum=false",
                  "parallel.distributed_optimizer=false", "parallel.backend='gloo'"):
        assert field in texts[0], field
    # the defaults (and the fields where they act) say nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_about_settings(ctx.cfg(), torch.device("cpu"), one_process=True)
    assert not [c for c in caught if "no effect on this run" in str(c.message)]


def test_gemm_backend_triton_is_taken_on_the_cpu_under_tritons_interpreter():
    """The refusal of model.gemm_backend=triton on the CPU leaves out Triton's interpreter, where the kernels run
    (TRITON_INTERPRET=1 read when triton is imported, so a fresh process)."""
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom moe_train.config_io import build_config\n"
            "from moe_train.trainer.launch import check_gemm_backend\n"
            "check_gemm_backend(build_config('tiny', overrides={'model.gemm_backend': 'triton'}), torch.device('cpu'))\n"
            "print('taken')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    assert done.stdout.strip() == "taken", done.stderr[-2000:]  # (refused without it: check_gemm_backend above)
