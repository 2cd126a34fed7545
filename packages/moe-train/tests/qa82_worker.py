"""The spawned ranks of test_qa82.py (importable by name, so spawned ranks can unpickle them): the real Trainer on
DP2 x EP2 gloo ranks with a capacity and the expert bias, recording each forward's experts, each dispatch's drops
and the bias after each step; then one capacity dispatch of its own."""

from __future__ import annotations

from pathlib import Path

import torch

import test_parallel_harness as h
from moe_kernels import AllToAllDispatcher, build_route_map

RATE = 0.01  # the bias moves by this a step: large beside fp32's resolution, distinct from the default
STEPS, GRAD_ACCUM = 3, 2


def config(run_dir: Path, data_dir: str):  # noqa: ANN201
    cfg = h.small_config(run_dir.parent, steps=STEPS, grad_accum=GRAD_ACCUM, micro_batch_size=2, eval_interval=STEPS,
                         eval_windows=4, log_interval=STEPS, save_interval=STEPS, device="cpu", threads=1)
    cfg.train.run_dir, cfg.data.path = str(run_dir), data_dir
    cfg.model.router.expert_bias_rate = RATE
    cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.expert_capacity_factor = 2, 2, 1.0
    cfg.parallel.collective_timeout_s = 60.0
    return cfg


def capacity_and_bias(rank: int, port: int, root: str, data_dir: str) -> dict:
    """{"forwards": [(step, layer, training, ids)], "dispatches": [(training, dropped)], "bias": [per step: {layer:
    bias}], "dropped_1_1": rows one dispatch with capacity_factor=1.1 dropped on this rank}."""
    from moe_train.trainer.loop import Trainer

    h.worker_env(rank, 2, port)
    trainer = Trainer(config(Path(root) / "run", data_dir))
    model = trainer.model
    # first, drawing no random number: capacity_factor=1.1 over T*k = 100 rows a rank, every row to expert 0 (on rank
    # 0): ceil(1.1 x 100) = 110 of its 200 received rows kept
    ep = trainer.runtime.groups.ep
    dispatcher = AllToAllDispatcher(ep, 4, 1.1)
    ids = torch.zeros(50, 2, dtype=torch.int64)
    result = dispatcher.dispatch(torch.ones(50, 8), build_route_map(ids, 4, backend="torch"))
    dispatcher.combine(result.rows, result, torch.ones(50, 2))
    step = [0]
    forwards: list[tuple] = []
    for index, router in model.routers():
        def hook(mod, inputs, out, index=index):  # noqa: ANN001, ANN202
            if not mod.recomputing:
                forwards.append((step[0], index, mod.training, out.expert_ids.clone()))
        router.register_forward_hook(hook)
    dispatches: list[tuple] = []
    dispatch = AllToAllDispatcher.dispatch

    def recorded(self, x, route_map):  # noqa: ANN001, ANN202
        result = dispatch(self, x, route_map)
        dispatches.append((model.training, int(result.dropped)))
        return result

    AllToAllDispatcher.dispatch = recorded
    bias: list[dict] = []
    update = trainer._update_expert_bias

    def update_and_record(apply: bool = True) -> None:
        update(apply)
        bias.append({index: r.expert_bias.clone() for index, r in model.routers()})
        step[0] += 1

    trainer._update_expert_bias = update_and_record
    trainer.train()
    AllToAllDispatcher.dispatch = dispatch

    del trainer
    return {"forwards": forwards, "dispatches": dispatches, "bias": bias, "dropped_1_1": int(result.dropped)}
