"""The spawned ranks of test_qa77.py (importable by name, so spawned ranks can unpickle them)."""

from __future__ import annotations

from pathlib import Path

import test_parallel_harness as h
from test_parallel_harness import small_config


def eager_and_compiled(rank: int, ports: list[int], root: str, data_dir: str) -> dict:
    """dp=2, ep=2, bf16 resident weights: 4 steps (evals at 2 and 4) eager into root/eager, then with train.compile
    into root/compiled, one Trainer each: {"graph_breaks": {...}, "graphs": n} of this rank's dynamo."""
    from torch._dynamo.utils import counters

    from moe_train.trainer.loop import Trainer

    for port, name in zip(ports, ("eager", "compiled")):
        h.worker_env(rank, 2, port)
        cfg = small_config(Path(root), device="cpu", threads=1, steps=4, save_interval=4, eval_interval=2,
                           micro_batch_size=2, compile=name == "compiled")
        cfg.train.run_dir, cfg.data.path = str(Path(root) / name), data_dir
        cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.param_dtype = 2, 2, "bf16"
        cfg.parallel.collective_timeout_s = 120.0
        Trainer(cfg).train()
        h.release_process_groups()
    return {"graph_breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}
