"""The spawned ranks of test_qa96.py (importable by name, so spawned ranks can unpickle them): the real Trainer on
DP2 x EP2 gloo ranks in float64, recording what an independent reference loop needs to redo the run in one process:
the initial weights, every micro-batch each rank trained on, the step records and the weights at the end."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import test_parallel_harness as h


class FakeClock:
    """Stands in for loop.time: one second per training step, nothing else takes time."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def config(run_dir: Path, data_dir: str, lb_loss_scope: str):  # noqa: ANN201
    """The trainer-reference config of test_qa96 on DP2 x EP2 (E=4: experts 0, 1 on rank 0 and 2, 3 on rank 1)."""
    import test_qa96 as t

    cfg = t.config(run_dir, data_dir)
    cfg.model.router.lb_loss_scope = lb_loss_scope
    cfg.train.threads = 1
    cfg.parallel.dp, cfg.parallel.ep = 2, 2
    cfg.parallel.fp32_grad_accum = False  # float64 gradients for float64 weights
    cfg.parallel.collective_timeout_s = 60.0
    return cfg


def train_dp2_ep2(rank: int, ports: list[int], root: str, data_dir: str) -> dict:
    """{scope: {"init", "final": this rank's weight pieces, "batches": [(x, y)] per micro-batch in order,
    "records": the step records of metrics.jsonl (rank 0), "bias": {router: expert_bias} at the end}}."""
    from moe_train.trainer import loop
    from moe_train.trainer.launch import make_runtime
    from moe_train.trainer.loop import Trainer

    out = {}
    for port, scope in zip(ports, ("micro_batch", "global")):
        h.worker_env(rank, 2, port)
        cfg = config(Path(root) / scope, data_dir, scope)
        runtime = make_runtime(cfg, torch.device("cpu"))
        runtime.param_dtype = torch.float64  # setup casts the weights; the masters and moments follow them
        clock = FakeClock()
        loop.time = clock
        trainer = Trainer(cfg, runtime=runtime)
        init = h.global_weights(runtime, trainer.model)
        batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        next_batch, train_step = trainer.sampler.next_batch, trainer._train_step

        def recorded(*args, next_batch=next_batch, batches=batches):  # noqa: ANN002, ANN202
            x, y = next_batch(*args)
            batches.append((x.clone(), y.clone()))
            return x, y

        def timed(train_step=train_step, clock=clock):  # noqa: ANN202
            clock.now += 1.0
            return train_step()

        trainer.sampler.next_batch, trainer._train_step = recorded, timed
        model = trainer.model
        trainer.train()
        lines = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        out[scope] = {"init": init, "final": h.global_weights(runtime, model), "batches": batches,
                      "records": [r for r in map(json.loads, lines) if "loss" in r],
                      "bias": {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}}
    return out
