"""Worker for test_distributed.py, importable by name from torch.multiprocessing.spawn children."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from ckpt_cases import bits_equal, check_load, make_state, requests_for, shards_for

from moe_ckpt import AsyncCheckpointer, LoadRequest, find_latest, load_checkpoint, save_checkpoint, step_dir


def save_then_reshard(rank: int, world: int, root: str) -> None:
    """Save with EP dim-0 splits + ZeRO flat ranges over `world` gloo ranks, reload in other layouts."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world)
    try:
        state = make_state(seed=42)  # the same global state on every rank; each saves only its slices
        run = Path(root) / "run"
        meta = {"step": 1, "layout": {"dp": world, "ep": world, "zero": "flat"}}
        save_checkpoint(step_dir(run, 1), shards_for(state, rank, world), meta, rank, world, dist.barrier)
        # async save from a background thread: its barrier runs on a gloo group of its own
        ckpt_group = dist.new_group(backend="gloo")
        ck = AsyncCheckpointer()
        ck.save(step_dir(run, 2), shards_for(state, rank, world), {**meta, "step": 2}, rank, world,
                lambda: dist.barrier(group=ckpt_group))
        dist.all_reduce(torch.ones(4))  # the training loop keeps using the default group meanwhile
        assert ck.wait().write_s > 0
        dist.barrier()
        assert find_latest(run) == step_dir(run, 2)

        # 4 ranks (this process plays ranks `rank` and `rank + 2`), dim-0 and flat layouts
        for virtual in (rank, rank + world):
            for style in ("dim0", "flat"):
                reqs = requests_for(virtual, 4, style)
                check_load(state, load_checkpoint(step_dir(run, 1), reqs), reqs)
        # 1 rank, whole tensors, from both the sync and the async checkpoint
        for step in (1, 2):
            got = load_checkpoint(step_dir(run, step))
            for name, t in state.items():
                assert bits_equal(got[name], t), f"rank {rank}: step {step} {name} differs"
        whole = requests_for(0, 1, "whole")
        check_load(state, load_checkpoint(run, whole), whole)
        out = load_checkpoint(run, [LoadRequest("experts.w1", (8, 6, 5), torch.float32)])
        assert bits_equal(out["experts.w1"], state["experts.w1"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def load_with_one_corrupt_shard(rank: int, world: int, root: str) -> None:
    """Save over `world` ranks, damage rank 1's shard file, then each rank loads only its own expert rows
    (so only rank 1 reads the damaged file) inside fail_together. Writes root/rank{r}.json."""
    import json
    import time

    from moe_ckpt import Box, fail_together

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world)
    try:
        state = make_state(seed=3)
        path = step_dir(Path(root) / "run", 1)
        save_checkpoint(path, shards_for(state, rank, world), {"step": 1}, rank, world, dist.barrier)
        if rank == 1:
            shard = path / "shard-00001-of-00002.safetensors"
            raw = bytearray(shard.read_bytes())
            raw[-1] ^= 0xFF  # same size, wrong checksum
            shard.write_bytes(bytes(raw))
        dist.barrier()
        shape = tuple(state["experts.w1"].shape)
        rows = Box.dim0(shape, 4 * rank, 4)
        start = time.monotonic()
        out = {"error": None, "message": ""}
        try:
            fail_together(lambda: load_checkpoint(path, [LoadRequest("experts.w1", shape, region=rows)]),
                          rank, world, lambda t: (dist.all_reduce(t), t)[1], f"loading {path}")
        except Exception as e:  # noqa: BLE001 - reported to the test
            out = {"error": type(e).__name__, "message": str(e)}
        out["seconds"] = time.monotonic() - start
        t = torch.ones(1)
        dist.all_reduce(t)
        out["then"] = "ok" if t.item() == world else f"all_reduce gave {t.item()}"
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()
