"""Reading a checkpoint tensor by tensor: a `load_checkpoint` call per tensor vs one `open_checkpoint`.

    uv run python packages/moe-ckpt/bench/bench_many_tensors.py \
        --out packages/moe-ckpt/bench/results/many_tensors.json [--tensors 4000] [--world 4] [--run-layers 24]

Synthetic part: `--tensors` small fp32 tensors saved by `--world` simulated ranks (threads), half of them
expert stacks split along dim 0 over the ranks (one piece per rank), half replicated (written by one rank
each, round-robin), then every tensor is read whole, one at a time, both ways. A call per tensor parses
and checks index.json and opens a shard file each time, so "per_call" is timed on every `--sample`-th
tensor and the total projected to all of them; `open_checkpoint` reads them all.

Export part (`--run-layers` > 0, needs moe-train): trains a tiny moe-train model with that many layers
for one step, then exports its checkpoint with `moe_train.hf_bridge.export_hf` twice: through a reader
registered to call `load_checkpoint` per tensor (what hf_bridge did before) and through the built-in one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from moe_ckpt import Box, LoadRequest, ShardSpec, even_split, load_checkpoint, open_checkpoint, save_checkpoint
from moe_ckpt.index import read_index
from provenance import source_commit  # this folder's (the script's own folder is first on sys.path)


def save_synthetic(path: Path, n: int, world: int) -> None:
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i // 8}.t{i % 8}": torch.randn(8, 16, generator=g) for i in range(n)}

    def shards(rank: int) -> list[ShardSpec]:
        out = []
        for i, (name, t) in enumerate(state.items()):
            if i % 2:  # an expert stack: every rank holds its rows
                off, rows = even_split(8, rank, world)
                out.append(ShardSpec(name, (8, 16), t[off : off + rows], Box.dim0((8, 16), off, rows)))
            else:  # replicated: one writer, round-robin over the ranks
                out.append(ShardSpec(name, (8, 16), t, writer=(i // 2) % world == rank))
        return out

    bar = threading.Barrier(world)
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            save_checkpoint(path, shards(rank), {"step": 0}, rank, world, bar.wait)
        except BaseException as e:
            errors.append(e)
            bar.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def bench_synthetic(tmp: Path, n: int, world: int, sample: int) -> dict:
    path = tmp / "ck"
    save_synthetic(path, n, world)
    parse_s = []
    for _ in range(3):
        t = time.perf_counter()
        names = list(read_index(path).tensors)
        parse_s.append(time.perf_counter() - t)
    sampled = names[::sample]

    t = time.perf_counter()
    for name in sampled:  # the pattern of hf_bridge before: one load_checkpoint per tensor
        load_checkpoint(path, [LoadRequest(name)], verify=False)
    per_call_s = (time.perf_counter() - t) / len(sampled)

    t = time.perf_counter()
    with open_checkpoint(path) as ckpt:  # verify=True: each file checksummed once
        ckpt.check_all_files()
        for name in names:
            ckpt.read([LoadRequest(name)])
    open_once_s = time.perf_counter() - t
    return {
        "tensors": n, "world": world, "index_bytes": (path / "index.json").stat().st_size,
        "index_parse_ms_min_of_3": round(min(parse_s) * 1e3, 2),
        "per_call_ms_per_tensor": round(per_call_s * 1e3, 3), "per_call_timed_tensors": len(sampled),
        "per_call_projected_s_all": round(per_call_s * n, 2),
        "open_checkpoint_ms_per_tensor": round(open_once_s / n * 1e3, 3),
        "open_checkpoint_s_all": round(open_once_s, 3),
        "speedup": round(per_call_s * n / open_once_s, 1),
    }


def bench_export(tmp: Path, layers: int) -> dict:
    from moe_ckpt import find_latest, inspect_checkpoint
    from moe_train import hf_bridge
    from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig
    from moe_train.data import prepare_data, stdlib_documents
    from moe_train.trainer.loop import Trainer

    data = prepare_data(list(stdlib_documents(200_000)), tmp / "data", vocab_size=512, source="bench")
    cfg = Config(
        model=ModelConfig(vocab_size=512, d_model=32, num_layers=layers, num_heads=4, num_kv_heads=2, qk_norm=True,
                          dense_hidden=64, dense_layers=[0], num_experts=4, expert_hidden=16, shared_expert_hidden=0,
                          router=RouterConfig(top_k=2, expert_bias=False)),
        data=DataConfig(path=str(data), seq_len=32),
        train=TrainConfig(steps=1, micro_batch_size=2, grad_accum=1, warmup_steps=1, eval_interval=0,
                          log_interval=1, save_interval=1, run_dir=str(tmp / "run"), progress=False),
        preset="bench")
    Trainer(cfg).train()
    ckpt = find_latest(tmp / "run" / "checkpoints")
    stored = set(inspect_checkpoint(ckpt)["tensors"])

    def per_call_reader(path: Path):  # hf_bridge's reader before open_checkpoint, registered ahead of the built-in
        found = hf_bridge._moe_ckpt_reader(path)
        if found is None:
            return None
        found[1].__exit__(None, None, None)

        def read(name: str) -> torch.Tensor:
            key = f"optim.{name}.master" if f"optim.{name}.master" in stored else name
            return load_checkpoint(path, [LoadRequest(key)], verify=False)[key]
        return found[0], read

    hf_bridge.register_checkpoint_reader(per_call_reader)
    try:
        before = hf_bridge.export_hf(tmp / "run", tmp / "hf-before", dtype="fp32")
    finally:
        hf_bridge.CHECKPOINT_READERS.remove(per_call_reader)
    after = hf_bridge.export_hf(tmp / "run", tmp / "hf-after", dtype="fp32")
    same = all((tmp / "hf-before" / f).read_bytes() == (tmp / "hf-after" / f).read_bytes()
               for f in os.listdir(tmp / "hf-after"))
    return {"layers": layers, "checkpoint_tensors": len(stored), "index_bytes": (ckpt / "index.json").stat().st_size,
            "hf_tensors": after.num_tensors, "export_per_call_s": round(before.seconds, 2),
            "export_open_checkpoint_s": round(after.seconds, 2), "identical_folders": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=4000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sample", type=int, default=10, help="time a call per tensor on every N-th tensor")
    ap.add_argument("--run-layers", type=int, default=24, help="0 skips the moe-train export part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict = {"command": shlex.join(["python", *sys.argv]), "host": platform.node(),
                    "time": datetime.datetime.now().isoformat(timespec="seconds"),
                    "load_avg": os.getloadavg(), "torch_threads": torch.get_num_threads(), "commit": source_commit()}
    with tempfile.TemporaryDirectory() as tmp:
        result["synthetic"] = bench_synthetic(Path(tmp), args.tensors, args.world, args.sample)
        print(json.dumps(result["synthetic"], indent=2), flush=True)
    if args.run_layers:
        with tempfile.TemporaryDirectory() as tmp:
            result["export"] = bench_export(Path(tmp), args.run_layers)
            print(json.dumps(result["export"], indent=2))
    result["load_avg_after"] = os.getloadavg()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
