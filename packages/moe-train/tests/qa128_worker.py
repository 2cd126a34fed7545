"""QA 128's two gloo ranks (spawned): what parallel.* fields change at dp=2 / ep=2, from one process group.

Each scenario builds the runtime `train` builds (launch.make_runtime) over the same default group, sets the model
up, runs one micro-batch forward, backward and optimizer step, and reports what the field should change."""

from __future__ import annotations

import torch

import test_parallel_harness as h
from moe_train.config import Config
from moe_train.model import Transformer
from moe_train.trainer.launch import make_runtime

# (name, {dotted field: value}) on top of qa128's base config at dp=2
SCENARIOS = [
    ("dp2", {}),
    ("dp2_no_distributed_optimizer", {"parallel.distributed_optimizer": False}),
    ("ep2", {"parallel.ep": 2}),
    ("ep2_capacity", {"parallel.ep": 2, "parallel.expert_capacity_factor": 1.0}),
]


def scenario_config(base: Config, changes: dict) -> Config:
    import copy

    cfg = copy.deepcopy(base)
    cfg.parallel.dp = 2
    for key, value in changes.items():
        *path, name = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, name, value)
    return cfg


def probe(rank: int, port: int, base: Config) -> dict:
    h.worker_env(rank, 2, port)
    out = {}
    runtime = None
    for name, changes in SCENARIOS:
        cfg = scenario_config(base, changes)
        torch.manual_seed(cfg.train.seed)
        runtime = make_runtime(cfg, torch.device("cpu"))
        model = runtime.setup(Transformer(cfg.model, device="meta"))
        moe = model.moe_layers()[0]
        # every token prefers experts 0 and 1 (held by EP rank 0): a capacity of 1 x tokens x top_k drops rows there
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[:2] = 1.0
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1), generator=g)
        ce, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
        runtime.backward(ce + aux, last_micro_batch=True)
        result = runtime.step(1e-3)
        opt = runtime.optimizer
        out[name] = {
            "master_numel": sum(st.master.numel() for states in opt.states for st in states),
            "local_experts": moe.experts.w_gate_up.shape[0],
            "dropped": float(runtime.all_reduce_sum(moe.router.take_stats()[-1:].clone()).item()),
            "lb_group": moe.router.lb_group is not None,
            "betas": tuple(opt.cfg.betas), "eps": opt.cfg.eps,
            "grad_norm": result.grad_norm,
        }
        runtime.sync.remove_hooks()
    runtime.close()
    return out
