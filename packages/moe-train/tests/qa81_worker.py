"""The spawned ranks of test_qa81.py (importable by name, so spawned ranks can unpickle them): dp=2 gloo runs with
bf16 resident weights, and the check that a rank's weights are its fp32 masters rounded to the weights' dtype."""

from __future__ import annotations

from pathlib import Path

import torch

import qa76_worker
import test_parallel_harness as h


def weights_off_masters(runtime) -> list[str]:  # noqa: ANN001
    """The weights of a DistributedRuntime (ep=1: each rank holds every weight whole) that differ from this rank's
    fp32 master pieces cast to the weight's dtype: [] when the resident weights are exactly the masters rounded."""
    shards = runtime.checkpoint_shards()
    weights = {s.global_name: s.tensor for s in shards if not s.global_name.startswith("optim.")}
    off = []
    for s in shards:
        name = s.global_name[len("optim."):-len(".master")] if s.global_name.endswith(".master") else None
        if name is None:
            continue
        w = weights[name].reshape(-1)[s.slice.start : s.slice.start + s.slice.length]
        if not torch.equal(w, s.tensor.to(w.dtype)):
            off.append(name)
    return off


def bf16_runs(rank: int, ports: list[int], root: str, data_dir: str, n: int) -> dict:
    """dp=2, parallel.param_dtype=bf16: `2n` steps straight (a save every n, evals every n), and `2n` steps stopped
    by Ctrl-C during step n+1 then resumed by a new Trainer; then the straight run's last checkpoint opened by a
    dp=2 run with fp32 weights (restored, not trained). {"stopped": str, "off": {phase: weights off the masters},
    "dtype": the fp32 run's weight dtypes}."""
    from moe_train.trainer.loop import Trainer

    root = Path(root)
    off: dict[str, list[str]] = {}
    stopped, dtype = "", []
    for port, name, phase in zip(ports, ("straight", "split", "split", "straight"),
                                 ("straight", "stopped", "resumed", "fp32")):
        h.worker_env(rank, 2, port)
        cfg = qa76_worker.dp2_config(root / name, data_dir, steps=2 * n, save_interval=n, eval_interval=n,
                                     log_interval=1, keep_last=3)
        cfg.parallel.param_dtype = "fp32" if phase == "fp32" else "bf16"
        trainer = Trainer(cfg)
        if phase == "stopped":
            qa76_worker.ctrl_c_in_step(trainer, n + 1)
        if phase == "fp32":
            trainer.restore(trainer.resume_point())
            dtype = sorted({str(p.dtype) for p in trainer.model.parameters()})
        else:
            try:
                trainer.train()
            except KeyboardInterrupt as e:
                stopped = str(e)
        off[phase] = weights_off_masters(trainer.runtime)
        if phase == "fp32":
            trainer.runtime.close()  # train() closes its own
        del trainer
        h.release_process_groups()
    return {"stopped": stopped, "off": off, "dtype": dtype}
