"""The spawned ranks of test_qa78.py (importable by name, so spawned ranks can unpickle them): random routing on two
gloo ranks (dp=2), straight and stopped then resumed."""

from __future__ import annotations

from pathlib import Path

import torch

import qa76_worker
import test_parallel_harness as h
from moe_train.model.router import Router


def random_routing(cfg):  # noqa: ANN001, ANN201
    """cfg with random routing and no expert bias (the draws alone pick the experts)."""
    cfg.model.router.routing = "random"
    cfg.model.router.expert_bias = False
    return cfg


def record_first_draw(into: list[torch.Tensor]):  # noqa: ANN201
    """Patch Router._select so that the expert ids of this process's first training forward land in `into`."""
    select = Router._select

    def recorded(self: Router, scores: torch.Tensor, k: int) -> torch.Tensor:
        ids = select(self, scores, k)
        if self.training and not self.recomputing and not into:
            into.append(ids.clone())
        return ids

    Router._select = recorded


def straight_and_split(rank: int, ports: list[int], root: str, data_dir: str, n: int) -> dict:
    """dp=2, random routing: `2n` steps straight (eval every 3, an async save every n), and `2n` steps stopped by
    Ctrl-C during step n+3 then resumed by a new Trainer: {"first_ids": this rank's first routing draw,
    "rng": this rank's torch CPU generator state after each of the three Trainers, "stopped": str}."""
    from moe_train.trainer.loop import Trainer

    root = Path(root)
    first_ids: list[torch.Tensor] = []
    record_first_draw(first_ids)
    rng: list[torch.Tensor] = []
    stopped = ""
    for port, name in zip(ports, ("straight", "split", "split")):
        h.worker_env(rank, 2, port)
        cfg = qa76_worker.dp2_config(root / name, data_dir, steps=2 * n, save_interval=n, eval_interval=3,
                                     log_interval=1, async_save=True, keep_last=3)
        trainer = Trainer(random_routing(cfg))
        if name == "split" and not stopped:
            qa76_worker.ctrl_c_in_step(trainer, n + 3)
        try:
            trainer.train()
        except KeyboardInterrupt as e:
            stopped = str(e)
        del trainer
        h.release_process_groups()
        rng.append(torch.get_rng_state())
    return {"first_ids": first_ids[0], "rng": rng, "stopped": stopped}
