"""World-size-1 overhead of the resident-weight DDP + distributed-optimizer path, and the FSDP2 baseline.

Runs the same model and synthetic batches through four runtimes, one after another, in one
process group of one rank, and reports tokens/s, step time and peak memory side by side:

  plain      LocalRuntime: torch AdamW over fp32 weights (the single-process trainer)
  ddp        DistributedRuntime: flat buffers, bucketed gradient sync, ZeRO-1 AdamW, fp32 weights
  ddp-bf16   the same with bf16 resident weights and fp32 gradient accumulation
  fsdp       FSDP2 (fully_shard, reshard after forward) + torch AdamW

GPU (lead's command; the device image has torch 2.11):
  PYTHONPATH=$(ls -d packages/*/src | paste -sd:) torchrun --nproc-per-node 1 \
      packages/moe-parallel/bench/ddp_overhead.py --out results.json
CPU smoke check:
  uv run torchrun --nproc-per-node 1 packages/moe-parallel/bench/ddp_overhead.py --device cpu \
      --presets tiny --steps 2 --warmup 1 --out /tmp/ddp_overhead.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from moe_parallel import ParallelLayout, build_groups
from moe_train.model import Transformer
from moe_train.presets import get_preset
from moe_train.trainer.distributed_runtime import DistributedRuntime
from moe_train.trainer.runtime import LocalRuntime

MODES = ("plain", "ddp", "ddp-bf16", "fsdp")


def make(mode: str, cfg, device: torch.device):  # noqa: ANN001, ANN201
    if mode == "plain":
        return LocalRuntime(cfg, device)
    cfg.parallel.strategy = "fsdp" if mode == "fsdp" else "ddp"
    groups = build_groups(ParallelLayout(1, 1, 1), cfg.model.num_experts)
    return DistributedRuntime(cfg, device, groups, param_dtype=torch.bfloat16 if mode == "ddp-bf16" else None)


def bench(mode: str, preset: str, args: argparse.Namespace, device: torch.device) -> dict:
    cfg = get_preset(preset)
    t = cfg.train
    t.grad_accum = args.grad_accum
    if args.micro_batch:
        t.micro_batch_size = args.micro_batch
    if args.layers:
        cfg.model.num_layers = args.layers
        cfg.model.dense_layers = [i for i in cfg.model.dense_layers if i < args.layers]
    seq = args.seq_len or cfg.data.seq_len
    rt = make(mode, cfg, device)
    torch.manual_seed(0)
    model = rt.setup(Transformer(cfg.model, device="meta"))
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, seq + 1), generator=gen).to(device)
               for _ in range(t.grad_accum)]

    def step() -> None:
        for i, b in enumerate(batches):
            with amp:
                ce, aux = model.loss(b[:, :-1], b[:, 1:])
            rt.backward((ce + aux) / t.grad_accum, last_micro_batch=i == t.grad_accum - 1)
        rt.step(t.lr)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = args.steps * t.grad_accum * t.micro_batch_size * seq
    out = {
        "preset": preset, "mode": mode, "tokens_per_s": tokens / elapsed, "step_ms": 1e3 * elapsed / args.steps,
        "micro_batch": t.micro_batch_size, "seq_len": seq, "grad_accum": t.grad_accum,
        "num_layers": cfg.model.num_layers, "params": sum(p.numel() for p in model.parameters()),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    if isinstance(rt, DistributedRuntime) and rt.sync is not None:
        rt.sync.remove_hooks()
    del model, rt, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,fine-grained-e8", help="comma-separated preset names")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch (0 = the preset's)")
    ap.add_argument("--seq-len", type=int, default=0, help="0 = the preset's")
    ap.add_argument("--layers", type=int, default=0, help="0 = the preset's")
    ap.add_argument("--out", default="ddp_overhead.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != 1:
        raise SystemExit(f"this bench measures world size 1; launched with {dist.get_world_size()} ranks")
    results = []
    for preset in args.presets.split(","):
        for mode in args.modes.split(","):
            try:
                r = bench(mode, preset, args, device)
            except torch.OutOfMemoryError as e:  # a baseline that does not fit is a result too
                r = {"preset": preset, "mode": mode, "error": f"out of memory: {e}"[:300]}
                gc.collect()
                torch.cuda.empty_cache()
            results.append(r)
            print(json.dumps(r), flush=True)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    for preset in args.presets.split(","):
        rows = {r["mode"]: r for r in results if r["preset"] == preset and "error" not in r}
        base = rows.get("plain", {}).get("tokens_per_s")
        for mode, r in rows.items():
            rel = f"{r['tokens_per_s'] / base:6.3f}x" if base else ""
            print(f"{preset:20s} {mode:9s} {r['tokens_per_s']:12.0f} tok/s {r['step_ms']:9.1f} ms/step {rel}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
