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
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import qa128_worker as w
import test_parallel_harness as h
from moe_train.config import Config, ConfigError, DataConfig, validate
from moe_train.config_io import build_config
from moe_train.model import Transformer, flops_per_token
from moe_train.model.layers import RMSNorm
from moe_train.model.rope import rope_tables
from moe_train.trainer import data_setup, launch
from moe_train.trainer.errors import TrainingError
from moe_train.trainer.loop import Trainer
from moe_train.trainer.mfu import run_peak_tflops
from moe_train.trainer.runtime import LocalRuntime
from moe_train.trainer.schedule import train_lr_at
from moe_train.trainer.start_warnings import warn_about_settings

EFFECTS: dict[str, tuple[str, Callable]] = {}


def effect(*names: str, what: str):
    def register(fn):
        for name in names:
            EFFECTS[name] = (what, fn)
        return fn
    return register


def leaf_fields(cls: type = Config, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += leaf_fields(type(default), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def setf(cfg: Config, key: str, value) -> None:  # noqa: ANN001
    *path, name = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, name, value)


class Ctx:
    """One test's small config, its data folder and tmp_path."""

    def __init__(self, tmp_path: Path, data: Path):
        self.tmp, self.data, self.n = tmp_path, data, 0

    def cfg(self, **changes) -> Config:
        self.n += 1
        cfg = h.small_config(self.tmp, steps=2, grad_accum=1, warmup_steps=1, eval_interval=0, save_interval=0,
                             log_interval=1, run_dir=str(self.tmp / f"run{self.n}"))
        cfg.data.path = str(self.data)
        for key, value in changes.items():
            setf(cfg, key.replace("__", "."), value)
        return validate(cfg)

    def run(self, cfg: Config) -> tuple[Trainer, list[dict], list[tuple]]:
        """Train cfg; the trainer, metrics.jsonl's records and the (tokens shape) of each training forward."""
        trainer = Trainer(cfg)
        shapes = []
        real = trainer.model.loss_terms

        def loss_terms(x, y):  # noqa: ANN001, ANN202
            if trainer.model.training:
                shapes.append(tuple(x.shape))
            return real(x, y)
        trainer.model.loss_terms = loss_terms
        trainer.train()
        lines = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()
        return trainer, [json.loads(line) for line in lines], shapes


def steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r and "event" not in r]


def model(cfg: Config, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(cfg.model, device="meta")
    m.to_empty(device="cpu")
    m.reset_parameters(seed)
    return m


def shapes_of(m: torch.nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def logits(cfg: Config) -> torch.Tensor:
    with torch.no_grad():
        return model(cfg)(TOKENS)[0]


def warned(fn: Callable) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return " | ".join(str(c.message) for c in caught)


def one_step_runtime(cfg: Config) -> LocalRuntime:
    """A LocalRuntime over cfg's model after one optimizer step at lr=1e-3 on TOKENS."""
    rt = LocalRuntime(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.train.seed)
    m = rt.setup(Transformer(cfg.model, device="meta"))
    ce, aux = m.loss(TOKENS[:, :-1], TOKENS[:, 1:])
    rt.backward(ce + aux, last_micro_batch=True)
    rt.grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    rt.result = rt.step(1e-3)
    return rt


class world1:
    """A DistributedRuntime at world size 1 (a layout that is not plain: train builds one in this process)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __enter__(self):
        self.rt = launch.make_runtime(self.cfg, torch.device("cpu"))
        self.model = self.rt.setup(Transformer(self.cfg.model, device="meta"))
        return self

    def __exit__(self, *exc):  # noqa: ANN002
        self.rt.close()


# ---- model ----------------------------------------------------------------------------------------------------

STRUCTURE = {  # field: (new value, {parameter: shape} the change gives, or None: the parameter is gone)
    "model.vocab_size": (256, {"embed.weight": (256, 32), "lm_head.weight": (256, 32)}),
    "model.d_model": (64, {"embed.weight": (512, 64), "blocks.1.mlp.router.weight": (4, 64)}),
    "model.num_layers": (3, {"blocks.2.attn.q_proj.weight": (32, 32)}),
    "model.num_heads": (8, {"blocks.0.attn.k_proj.weight": (8, 32), "blocks.0.attn.q_norm.weight": (4,)}),
    "model.num_kv_heads": (4, {"blocks.0.attn.k_proj.weight": (32, 32)}),
    "model.head_dim": (16, {"blocks.0.attn.q_proj.weight": (64, 32), "blocks.0.attn.o_proj.weight": (32, 64)}),
    "model.qk_norm": (False, {"blocks.0.attn.q_norm.weight": None, "blocks.0.attn.k_norm.weight": None}),
    "model.attention_bias": (True, {"blocks.0.attn.q_proj.bias": (32,), "blocks.0.attn.v_proj.bias": (16,),
                                    "blocks.0.attn.o_proj.bias": None}),
    "model.dense_hidden": (48, {"blocks.0.mlp.gate.weight": (48, 32)}),
    "model.dense_layers": ([1], {"blocks.0.mlp.router.weight": (4, 32), "blocks.1.mlp.gate.weight": (64, 32)}),
    "model.num_experts": (8, {"blocks.1.mlp.experts.w_gate_up": (8, 32, 32), "blocks.1.mlp.router.weight": (8, 32)}),
    "model.expert_hidden": (8, {"blocks.1.mlp.experts.w_gate_up": (4, 32, 16), "blocks.1.mlp.experts.w_down": (4, 8, 32)}),
    "model.shared_expert_hidden": (8, {"blocks.1.mlp.shared_expert.up.weight": (8, 32)}),
    "model.shared_expert_gate": (True, {"blocks.1.mlp.shared_expert_gate.weight": (1, 32)}),
    "model.tie_embeddings": (True, {"lm_head.weight": None}),  # one tensor: named once, as embed.weight
}


@effect(*STRUCTURE, what="the parameters' names and shapes, and the forward's logits")
def check_structure(ctx: Ctx, name: str) -> None:
    value, expected = STRUCTURE[name]
    base, changed = ctx.cfg(), ctx.cfg(**{name: value})
    shapes = shapes_of(model(changed))
    for pname, shape in expected.items():
        assert shapes.get(pname) == shape, (name, pname, shapes.get(pname))
    if name == "model.tie_embeddings":
        m = model(changed)
        assert m.lm_head.weight is m.embed.weight
    if name == "model.attention_bias":  # initialised to zero (README "Model"): the same forward at init
        m = model(changed)
        assert all(torch.all(p == 0) for n, p in m.named_parameters() if n.endswith(".bias"))
        m(TOKENS)[0].square().mean().backward()
        assert m.blocks[0].attn.q_proj.bias.grad.abs().sum() > 0
    elif name != "model.vocab_size":
        assert not torch.allclose(logits(base), logits(changed))


@effect("model.norm_eps", what="every RMSNorm's eps (blocks, QK-norm, final norm) and the logits")
def check_norm_eps(ctx: Ctx, name: str) -> None:
    base, changed = ctx.cfg(), ctx.cfg(**{name: 0.5})
    norms = [mod for mod in model(changed).modules() if isinstance(mod, RMSNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1 and all(n.eps == 0.5 for n in norms)
    assert not torch.allclose(logits(base), logits(changed))


@effect("model.init_std", what="the std of every weight drawn at init (not norms: 1, nor biases: 0)")
def check_init_std(ctx: Ctx, name: str) -> None:
    m = model(ctx.cfg(**{name: 0.05, "model.attention_bias": True, "model.shared_expert_gate": True}))
    for pname, p in m.named_parameters():
        if pname.endswith("norm.weight"):
            assert torch.all(p == 1), pname
        elif pname.endswith(".bias"):
            assert torch.all(p == 0), pname
        elif p.numel() >= 256:
            assert abs(p.std().item() - 0.05) < 0.1 * 0.05, (pname, p.std().item())
        else:  # the shared-expert gate's 32 values
            assert 0.02 < p.std().item() < 0.1, (pname, p.std().item())


@effect("model.rope_theta", "model.rotary_fraction", what="the rotary tables (theta, rotated dims) and the logits")
def check_rope(ctx: Ctx, name: str) -> None:
    value = 500.0 if name == "model.rope_theta" else 0.5
    base, changed = ctx.cfg(), ctx.cfg(**{name: value})
    m = model(changed)
    cos, sin = m._rope(16, torch.device("cpu"), torch.float32)
    want_cos, _ = rope_tables(16, changed.model.rotary_dim, changed.model.rope_theta, torch.device("cpu"),
                              torch.float32)
    assert cos.shape[-1] == (8 if name == "model.rope_theta" else 4)
    torch.testing.assert_close(cos, want_cos)
    assert not torch.allclose(logits(base), logits(changed))


@effect("model.sliding_window_pattern", what="each layer's attention window: its mask, the flops and the logits")
def check_sliding_window(ctx: Ctx, name: str) -> None:
    base, changed = ctx.cfg(), ctx.cfg(**{name: [3, 0]})
    m = model(changed)
    masks = m._attention_masks(TOKENS, torch.float32)
    assert masks[1] is None and masks[0] is not None and bool((masks[0][0, 0, 5, 1] < 0) & (masks[0][0, 0, 5, 3] == 0))
    assert flops_per_token(changed.model, TOKENS.shape[1]) < flops_per_token(base.model, TOKENS.shape[1])
    assert not torch.allclose(logits(base), logits(changed))


@effect("model.gemm_backend", what="the backend the expert block's kernels get (triton on the CPU: refused)")
def check_gemm_backend(ctx: Ctx, name: str, monkeypatch) -> None:
    from moe_precision import PrecisionRecipe

    seen = []
    real = PrecisionRecipe.fused_moe_ffn
    monkeypatch.setattr(PrecisionRecipe, "fused_moe_ffn", lambda self, *a: seen.append(a[-1]) or real(self, *a))
    logits(ctx.cfg(**{name: "reference"}))
    assert seen == ["reference"]
    with pytest.raises(ValueError, match="backend='triton' got a tensor on device=cpu"):
        logits(ctx.cfg(**{name: "triton"}))
    # the trainer refuses it by the field's name before the process group, the data or the run folder (it was
    # refused only at the first forward, after the run folder and its start event, naming moe-kernels' argument)
    cfg = ctx.cfg(**{name: "triton"})
    with pytest.raises(ConfigError, match=r"model\.gemm_backend='triton': expected 'auto', 'torch' or 'reference' "
                                          r"on the cpu"):
        Trainer(cfg)
    assert not Path(cfg.train.run_dir).exists()


@effect("model.precision", what="the recipe of every layer; its one value today, any other refused")
def check_precision(ctx: Ctx, name: str) -> None:
    m = model(ctx.cfg())
    assert m.moe_layers()[0].recipe.name == "bf16"
    with pytest.raises(ConfigError, match=r"model\.precision='mxfp8'"):
        ctx.cfg(**{name: "mxfp8"})


# ---- router -----------------------------------------------------------------------------------------------------

def route(cfg: Config):  # noqa: ANN201
    m = model(cfg)
    router = m.moe_layers()[0].router
    x = torch.randn(64, cfg.model.d_model, generator=torch.Generator().manual_seed(1))
    router.train()
    return router, x, router(x)


@effect("model.router.top_k", "model.router.normalize_top_k", "model.router.routed_scaling_factor",
        "model.router.gating", what="the router's selected experts and their weights")
def check_router_weights(ctx: Ctx, name: str) -> None:
    value = {"model.router.top_k": 3, "model.router.normalize_top_k": False, "model.router.routed_scaling_factor": 2.5,
             "model.router.gating": "sigmoid"}[name]
    router, x, out = route(ctx.cfg(**{name: value, "model.router.expert_bias": False}))
    logits_ = x @ router.weight.T
    probs = logits_.sigmoid() if name == "model.router.gating" else logits_.softmax(-1)
    k = 3 if name == "model.router.top_k" else 2
    ids = probs.topk(k, -1).indices
    assert torch.equal(out.expert_ids, ids)
    weights = probs.gather(1, ids)
    if name != "model.router.normalize_top_k":
        weights = weights / weights.sum(-1, keepdim=True)
    if name == "model.router.routed_scaling_factor":
        weights = weights * 2.5
    torch.testing.assert_close(out.weights, weights)


@effect("model.router.routing", what="who chooses the experts: random draws, uniform is arange % E")
def check_routing(ctx: Ctx, name: str) -> None:
    _, _, learned = route(ctx.cfg())
    _, _, uniform = route(ctx.cfg(**{name: "uniform"}))
    assert torch.equal(uniform.expert_ids.flatten(), torch.arange(128) % 4)
    _, _, rand = route(ctx.cfg(**{name: "random"}))
    assert not torch.equal(rand.expert_ids, learned.expert_ids)


@effect("model.router.lb_loss_weight", "model.router.z_loss_weight",
        what="the aux loss: lb_loss_weight x E.sum(f.P) + z_loss_weight x mean(logsumexp^2)")
def check_aux_weights(ctx: Ctx, name: str) -> None:
    router, x, out = route(ctx.cfg(**{"model.router.lb_loss_weight": 0.3, "model.router.z_loss_weight": 0.7,
                                      "model.router.expert_bias": False}))
    logits_ = x @ router.weight.T
    f = torch.bincount(out.expert_ids.flatten(), minlength=4).float() / out.expert_ids.numel()
    lb = 4 * (f * logits_.softmax(-1).mean(0)).sum()
    z = torch.logsumexp(logits_, -1).pow(2).mean()
    torch.testing.assert_close(out.aux_loss, 0.3 * lb + 0.7 * z)


@effect("model.router.lb_loss_scope", what="global: the expert counts are all-reduced over the router's lb_group")
def check_lb_scope(ctx: Ctx, name: str, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None: calls.append(group))
    for scope in ("micro_batch", "global"):
        m = model(ctx.cfg(**{name: scope}))
        m.moe_layers()[0].router.lb_group = "dp-group"
        m(TOKENS)
    assert calls == ["dp-group"]  # the global scope's forward only


@effect("model.router.expert_bias", "model.router.expert_bias_rate",
        what="the bias moves by expert_bias_rate per step from the step's load; selection only; saved when on")
def check_expert_bias(ctx: Ctx, name: str) -> None:
    load = torch.tensor([10.0, 0.0, 5.0, 5.0])
    for on, rate in ((True, 0.25), (False, 0.25)):
        router, _, _ = route(ctx.cfg(**{"model.router.expert_bias": on, "model.router.expert_bias_rate": rate}))
        router.update_expert_bias(load)
        want = torch.tensor([-0.25, 0.25, 0.0, 0.0]) if on else torch.zeros(4)
        assert torch.equal(router.expert_bias, want)
        assert ("expert_bias" in router.state_dict()) == on
    # selection only: a bias changes the experts chosen, never the weights' source (the probabilities)
    router, x, plain = route(ctx.cfg())
    router.expert_bias[:] = torch.tensor([10.0, 10.0, 0.0, 0.0])
    biased = router(x)
    assert torch.all(biased.expert_ids < 2) and not torch.equal(biased.expert_ids, plain.expert_ids)
    # the rate without the bias: no effect, said so
    cfg = ctx.cfg(**{"model.router.expert_bias": False, "model.router.expert_bias_rate": 0.25})
    assert "model.router.expert_bias_rate=0.25" in warned(lambda: warn_about_settings(cfg, torch.device("cpu")))


# ---- data -------------------------------------------------------------------------------------------------------

@effect("data.path", what="the folder the run reads (a missing one is refused naming it)")
def check_data_path(ctx: Ctx, name: str) -> None:
    from moe_train.data import DataError

    trainer = Trainer(ctx.cfg())
    assert trainer.data_dir == ctx.data
    trainer.runtime.close()
    trainer._release_run_dir()
    with pytest.raises(DataError, match="nowhere"):
        Trainer(ctx.cfg(**{name: str(ctx.tmp / "nowhere")}))


CORPUS = {"data.cache_dir": "elsewhere", "data.default_vocab_size": 300, "data.default_max_bytes": 1000,
          "data.eval_fraction": 0.25}


@effect(*CORPUS, what="the embedded corpus's folder and prepare_data's arguments; warned as ignored with a folder")
def check_corpus_fields(ctx: Ctx, name: str, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(data_setup, "stdlib_documents", lambda n: calls.append(("bytes", n)) or ["doc"])
    monkeypatch.setattr(data_setup, "prepare_data", lambda docs, folder, **kw: calls.append((folder, kw)))
    value = CORPUS[name]
    if name == "data.cache_dir":
        value = str(ctx.tmp / value)
    d = dataclasses.replace(DataConfig(), path="default", cache_dir=str(ctx.tmp / "cache"))
    setf(d, name.split(".")[1], value)
    folder = data_setup.resolve_data_dir(d, is_main=True)
    (bytes_call, n), (prepared, kw) = calls
    assert prepared == folder
    got = {"data.cache_dir": str(folder.parent), "data.default_vocab_size": kw["vocab_size"],
           "data.default_max_bytes": n, "data.eval_fraction": kw["eval_fraction"]}[name]
    assert got == value
    assert folder != data_setup.default_data_dir(DataConfig(cache_dir=str(ctx.tmp / "cache")))
    text = warned(lambda: build_config("tiny", overrides={"data.path": str(ctx.data), name: CORPUS[name]}))
    assert f"{name}=" in text and "is ignored" in text


@effect("data.seq_len", what="the length of every training window")
def check_seq_len(ctx: Ctx, name: str) -> None:
    _, _, shapes = ctx.run(ctx.cfg(**{name: 16, "train.steps": 1}))
    assert shapes == [(4, 16)]


@effect("data.seed", "train.seed", what="data.seed: the window order, not the init; train.seed: the init, not the order")
def check_seeds(ctx: Ctx, name: str) -> None:
    def first(cfg):  # noqa: ANN001, ANN202
        trainer = Trainer(cfg)
        x, _ = trainer.sampler.next_batch(4)
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.runtime.close()
        trainer._release_run_dir()
        return x, weights

    (x0, w0), (x1, w1) = first(ctx.cfg()), first(ctx.cfg(**{name: 7}))
    same_init = all(torch.equal(w0[k], w1[k]) for k in w0)
    assert (not torch.equal(x0, x1), same_init) == ((True, True) if name == "data.seed" else (False, False))


# ---- train ------------------------------------------------------------------------------------------------------

@effect("train.steps", "train.log_interval", what="the step records metrics.jsonl gets")
def check_step_records(ctx: Ctx, name: str) -> None:
    value = {"train.steps": 3, "train.log_interval": 2}[name]
    _, records, _ = ctx.run(ctx.cfg(**{name: value}))
    assert [r["step"] for r in steps(records)] == ([1, 2, 3] if name == "train.steps" else [2])


@effect("train.micro_batch_size", "train.grad_accum", what="the forwards of a step and their batch size")
def check_batching(ctx: Ctx, name: str) -> None:
    _, records, shapes = ctx.run(ctx.cfg(**{name: 2, "train.steps": 1}))
    assert shapes == ([(2, 32)] if name == "train.micro_batch_size" else [(4, 32), (4, 32)])


LR_CHANGES = {"train.lr": 1e-3, "train.min_lr_ratio": 0.5, "train.warmup_steps": 3, "train.lr_schedule": "linear",
              "train.lr_decay_fraction": 0.5}


@effect(*LR_CHANGES, what="the lr trajectory (closed forms), which the optimizer steps with")
def check_lr(ctx: Ctx, name: str) -> None:
    base = {"train.steps": 10, "train.warmup_steps": 1, "train.lr": 3e-3, "train.min_lr_ratio": 0.1}
    if name == "train.lr_decay_fraction":
        base["train.lr_schedule"] = "wsd"
    cfg = ctx.cfg(**{**base, name: LR_CHANGES[name]})
    t = cfg.train
    lrs = [train_lr_at(s, t) for s in range(10)]
    lr, lo = t.lr, t.lr * t.min_lr_ratio
    cosine = [lr] + [lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * (s - 1) / 9)))
                     for s in range(1, 10)]
    want = {
        "train.lr": cosine,
        "train.min_lr_ratio": cosine,
        "train.warmup_steps": [lr / 3, 2 * lr / 3, lr] + [lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 7)))
                                                          for s in range(3, 10)],
        "train.lr_schedule": [lr] + [lr - (lr - lo) * (s - 1) / 9 for s in range(1, 10)],
        "train.lr_decay_fraction": [lr] * 6 + [lr - (lr - lo) * (s - 5) / 5 for s in range(6, 10)],  # last 5 of 10
    }[name]
    assert lrs == pytest.approx(want, rel=1e-12)
    if name == "train.lr":  # the Trainer steps with them: records and the optimizer's lr
        cfg.train.steps = 2
        trainer, records, _ = ctx.run(cfg)
        assert [r["lr"] for r in steps(records)] == [train_lr_at(s, cfg.train) for s in range(2)] == [1e-3, 1e-3]
        assert trainer.runtime.optimizer.param_groups[0]["lr"] == 1e-3
    if name == "train.min_lr_ratio":  # constant never decays to it: warned
        cfg = ctx.cfg(**{"train.lr_schedule": "constant", name: 0.5})
        assert "train.min_lr_ratio=0.5" in warned(lambda: warn_about_settings(cfg, torch.device("cpu")))


@effect("train.weight_decay", "train.beta1", "train.beta2", "train.eps",
        what="AdamW's settings on one process and in the distributed optimizer, and the moments after a step")
def check_adamw(ctx: Ctx, name: str) -> None:
    value = {"train.weight_decay": 0.0, "train.beta1": 0.5, "train.beta2": 0.7, "train.eps": 1e-3}[name]
    cfg = ctx.cfg(**{name: value, "train.grad_clip": 0.0})
    t = cfg.train
    rt = one_step_runtime(cfg)
    decay, no_decay = rt.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["betas"], decay["eps"]) == (
        t.weight_decay, 0.0, (t.beta1, t.beta2), t.eps)
    assert {p.dim() for p in decay["params"]} >= {2, 3} and {p.dim() for p in no_decay["params"]} == {1}
    for pname, p in rt.model.named_parameters():
        st, g = rt.optimizer.state[p], rt.grads[pname]
        torch.testing.assert_close(st["exp_avg"], (1 - t.beta1) * g)
        torch.testing.assert_close(st["exp_avg_sq"], (1 - t.beta2) * g * g)
    for distributed_optimizer in (True, False):  # moe-parallel's DistributedAdamW (world 1: bf16 weights)
        dcfg = ctx.cfg(**{name: value, "parallel.param_dtype": "bf16",
                          "parallel.distributed_optimizer": distributed_optimizer})
        with world1(dcfg) as d:
            c = d.rt.optimizer.cfg
            assert (c.betas, c.eps, c.weight_decay) == ((t.beta1, t.beta2), t.eps, t.weight_decay)
    fcfg = ctx.cfg(**{name: value, "parallel.strategy": "fsdp"})  # the FSDP2 baseline's torch AdamW
    with world1(fcfg) as d:
        group = d.rt.torch_optimizer.param_groups[0]
        assert (group["betas"], group["eps"], group["weight_decay"]) == ((t.beta1, t.beta2), t.eps, t.weight_decay)


@effect("train.grad_clip", what="the gradient reaching AdamW is clipped to that global norm (0: not clipped)")
def check_grad_clip(ctx: Ctx, name: str) -> None:
    for clip in (1e-3, 0.0):
        rt = one_step_runtime(ctx.cfg(**{name: clip}))
        norm = rt.result.grad_norm
        moments = torch.stack([rt.optimizer.state[p]["exp_avg"].norm() for p in rt.model.parameters()]).norm()
        assert norm > 1e-2
        assert moments.item() == pytest.approx(0.1 * (min(norm, clip) if clip else norm), rel=1e-4)


@effect("train.eval_interval", "train.eval_windows", what="the eval records, and the number of eval sequences")
def check_eval(ctx: Ctx, name: str) -> None:
    if name == "train.eval_interval":
        _, records, _ = ctx.run(ctx.cfg(**{name: 1}))
        assert [r["step"] for r in records if "eval_loss" in r] == [0, 1, 2]
    else:
        trainer = Trainer(ctx.cfg(**{name: 5, "train.eval_interval": 1}))
        assert sum(x.shape[0] for x, _ in trainer.eval_data) == 5
        trainer.runtime.close()
        trainer._release_run_dir()


@effect("train.save_interval", "train.keep_last", "train.async_save", "train.run_dir",
        what="the checkpoints written, how many are kept, the async writer's record, where")
def check_saves(ctx: Ctx, name: str) -> None:
    value = {"train.save_interval": 1, "train.keep_last": 1, "train.async_save": True,
             "train.run_dir": str(ctx.tmp / "chosen")}[name]
    cfg = ctx.cfg(**{"train.save_interval": 1, "train.keep_last": 3, "train.steps": 3, name: value})
    _, records, _ = ctx.run(cfg)
    kept = sorted(int(p.name.split("-")[1]) for p in (Path(cfg.train.run_dir) / "checkpoints").glob("step-*"))
    assert kept == ([3] if name == "train.keep_last" else [1, 2, 3])
    assert any(r.get("event") == "async_save" for r in records) == (name == "train.async_save")
    if name == "train.run_dir":
        assert (ctx.tmp / "chosen" / "metrics.jsonl").is_file()


@effect("train.resume", "train.init_from", what="where the run starts: the checkpoint's step, or its weights at step 0")
def check_start(ctx: Ctx, name: str) -> None:
    first = ctx.cfg(**{"train.save_interval": 2})
    trainer, _, _ = ctx.run(first)
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    if name == "train.resume":
        again = ctx.cfg(**{"train.steps": 3, "train.save_interval": 2, "train.run_dir": first.train.run_dir})
        _, records, _ = ctx.run(again)
        assert [r for r in records if r.get("event") == "start"][-1]["resumed_from_step"] == 2
        with pytest.raises(Exception, match="train.run_dir"):  # another run's history is not trained over
            ctx.run(ctx.cfg(**{"train.steps": 3, "train.run_dir": first.train.run_dir, name: False}))
    else:
        cfg = ctx.cfg(**{name: first.train.run_dir, "train.steps": 1})
        trainer = Trainer(cfg)
        real = trainer._train_step
        seen = {}

        def step():  # noqa: ANN202
            seen.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
            return real()
        trainer._train_step = step
        trainer.train()
        assert all(torch.equal(seen[k], saved[k]) for k in saved)


@effect("train.device", "train.autocast_bf16", what="CPU: cuda refused with no GPU; autocast never on the CPU")
def check_device(ctx: Ctx, name: str) -> None:
    if name == "train.device":
        assert launch.pick_device("cpu") == launch.pick_device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match="train.device='cuda'"):
            Trainer(ctx.cfg(**{name: "cuda"}))
    else:
        cfg = ctx.cfg(**{name: False, "train.steps": 1})
        _, off, _ = ctx.run(cfg)
        trainer, on, _ = ctx.run(ctx.cfg(**{"train.steps": 1}))
        assert trainer.autocast is False and steps(off)[0]["loss"] == steps(on)[0]["loss"]
        assert run_peak_tflops(cfg, torch.device("cpu")) is None


@effect("train.activation_checkpointing", "train.compile", what="what each block recomputes; compiled modules")
def check_runtime_choices(ctx: Ctx, name: str) -> None:
    value = "mlp" if name == "train.activation_checkpointing" else True
    trainer = Trainer(ctx.cfg(**{name: value}))
    m = trainer.model
    assert [b.recompute for b in m.blocks] == ["mlp", "mlp"] if value == "mlp" else m.compiled is True
    trainer.runtime.close()
    trainer._release_run_dir()


@effect("train.loss_chunk_tokens", what="the model's loss chunks; the same losses; no whole logits kept for backward")
def check_loss_chunks(ctx: Ctx, name: str) -> None:
    trainer, chunked, _ = ctx.run(ctx.cfg(**{name: 9}))
    assert trainer.model.loss_chunk_tokens == 9
    _, plain, _ = ctx.run(ctx.cfg())
    torch.testing.assert_close([r["loss"] for r in steps(chunked)], [r["loss"] for r in steps(plain)], rtol=1e-5,
                               atol=1e-6)
    sizes = []
    x = torch.randint(0, trainer.cfg.model.vocab_size, (4, trainer.cfg.data.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        trainer.model.loss(x, x)
    assert max(sizes) < x.numel() * trainer.cfg.model.vocab_size


@effect("train.lm_z_loss_weight", what="the LM head's z-loss: logged as lm_z_loss, and it changes the training")
def check_lm_z_loss(ctx: Ctx, name: str) -> None:
    trainer, with_z, _ = ctx.run(ctx.cfg(**{name: 0.05}))
    assert trainer.model.lm_z_loss_weight == 0.05
    _, plain, _ = ctx.run(ctx.cfg())
    assert all(r["lm_z_loss"] > 0 for r in steps(with_z)) and all("lm_z_loss" not in r for r in steps(plain))
    # the first step's loss is the same cross-entropy (the z-loss only changes the update; summed in another order
    # there); the second step's differs by more than that rounding
    first, second = (abs(steps(with_z)[i]["loss"] - steps(plain)[i]["loss"]) for i in (0, 1))
    assert first < 1e-5 < second, (first, second)


@effect("train.document_masking", what="the model's document mask from the data's eos_id")
def check_document_masking(ctx: Ctx, name: str) -> None:
    trainer, _, _ = ctx.run(ctx.cfg(**{name: True}))
    assert trainer.model.document_eos_id == trainer.meta["eos_id"]
    plain_trainer, _, _ = ctx.run(ctx.cfg())
    assert plain_trainer.model.document_eos_id is None
    x, _ = trainer.sampler.next_batch(4, 0, 1)
    x[:, ::5] = trainer.meta["eos_id"]  # documents of 5 tokens: the mask changes every later position's logits
    causal = copy.deepcopy(trainer.model)
    causal.set_document_masking(None)
    with torch.no_grad():
        assert not torch.allclose(trainer.model(x)[0][:, 6:], causal(x)[0][:, 6:], atol=1e-4)


@effect("train.document_masking_kernel", what="how attention applies the document mask (FlexAttention or SDPA)")
def check_document_masking_kernel(ctx: Ctx, name: str) -> None:
    trainer, _, _ = ctx.run(ctx.cfg(**{"train.document_masking": True, name: "sdpa"}))
    assert trainer.model.document_mask_kernel == "sdpa"
    assert trainer.model.document_masking_path(torch.device("cuda"), torch.bfloat16) == "sdpa"
    # FlexAttention has no CPU backward: 'flex' on this CPU is refused when the trainer is built, before any step
    with pytest.raises(ValueError, match="document_masking_kernel='flex'"):
        Trainer(ctx.cfg(**{"train.document_masking": True, name: "flex"}))


@effect("train.progress", what="the progress bar and lines on the terminal")
def check_progress(ctx: Ctx, name: str, capsys) -> None:
    ctx.run(ctx.cfg(**{"train.steps": 1, "train.eval_interval": 1, name: False}))
    quiet = capsys.readouterr()
    ctx.run(ctx.cfg(**{"train.steps": 1, "train.eval_interval": 1, name: True}))
    loud = capsys.readouterr()
    assert "eval loss" not in quiet.out + quiet.err and "step 1: eval loss" in loud.out + loud.err


@effect("train.threads", what="torch.get_num_threads() from the Trainer's start")
def check_threads(ctx: Ctx, name: str) -> None:
    before = torch.get_num_threads()
    try:
        target = 1 if before != 1 else 2
        trainer = Trainer(ctx.cfg(**{name: target}))
        assert torch.get_num_threads() == target
        trainer.runtime.close()
        trainer._release_run_dir()
    finally:
        torch.set_num_threads(before)


@effect("train.max_skipped_steps", what="how many non-finite steps in a row the run tolerates")
def check_max_skipped(ctx: Ctx, name: str) -> None:
    def poisoned(cfg):  # noqa: ANN001, ANN202
        trainer = Trainer(cfg)
        real = trainer.model.loss_terms
        trainer.model.loss_terms = lambda x, y: (lambda t: t._replace(ce=t.ce + float("inf")))(real(x, y))
        return trainer

    assert poisoned(ctx.cfg(**{name: 3, "train.steps": 2})).train()["skipped_steps"] == 2
    with pytest.raises(TrainingError, match=r"for 2 consecutive steps \(steps 1 to 2\); train.max_skipped_steps=2"):
        poisoned(ctx.cfg(**{name: 2, "train.steps": 3})).train()


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
