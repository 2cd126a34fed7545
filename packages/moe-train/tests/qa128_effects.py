"""QA 128's registry of config-field effect checks (effect, EFFECTS) and what the checks share: a small CPU
config per check (Ctx), a model, its logits, one optimizer step, a world-1 distributed runtime."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import test_parallel_harness as h
from moe_train.config import Config, validate
from moe_train.model import Transformer
from moe_train.trainer import launch
from moe_train.trainer.loop import Trainer
from moe_train.trainer.runtime import LocalRuntime

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
