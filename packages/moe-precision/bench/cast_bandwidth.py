"""Bandwidth of the gradient cast bf16 -> fp32: `moe_precision.cast.upcast` (the Triton kernel `cast_weight`'s
backward runs on CUDA) against torch's `t.to(torch.float32)` (what autocast's backward runs), side by side.

Each is timed on the same contiguous bf16 tensor with CUDA events (median of --reps after --warmup), alternating
the two so both see the same clocks; bytes moved = 2 (read) + 4 (write) per element. The two outputs are checked
bit-identical before any timing. Writes JSON with the GPU, versions and commit.

GPU:  source tools/gpu_env.sh; python3 packages/moe-precision/bench/cast_bandwidth.py --out results.json
CPU smoke check (both sides are torch's cast there: a check that the script runs, not a measurement):
      uv run python packages/moe-precision/bench/cast_bandwidth.py --device cpu --numel 100000 --reps 3 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from moe_precision.cast import upcast

BYTES_PER_ELEMENT = 2 + 4  # read bf16, write fp32


def timed(fn, device: torch.device) -> float:  # noqa: ANN001
    """Seconds one call of fn takes (CUDA events on a GPU, perf_counter on the CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 30, help="elements of the bf16 tensor (default 2**30: 2 GiB)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.numel < 1 or args.reps < 1 or args.warmup < 0:
        p.error(f"--numel={args.numel}, --reps={args.reps}, --warmup={args.warmup}: expected >= 1, >= 1, >= 0")
    device = torch.device(args.device)
    src = torch.randn(args.numel, device=device).to(torch.bfloat16)
    sides = {"triton_upcast": lambda: upcast(src, torch.float32), "torch_to": lambda: src.to(torch.float32)}
    if not torch.equal(sides["triton_upcast"]().view(torch.int32), sides["torch_to"]().view(torch.int32)):
        raise SystemExit("upcast and .to(torch.float32) differ: not timing a wrong kernel")
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.warmup + args.reps):
        for name, fn in sides.items():
            seconds = timed(fn, device)
            if i >= args.warmup:
                times[name].append(seconds)
    moved = BYTES_PER_ELEMENT * args.numel
    result = {
        "what": "bf16 -> fp32 cast bandwidth, median of reps, TB/s = 6 bytes per element / time",
        "numel": args.numel, "reps": args.reps, "warmup": args.warmup,
        "median_s": {name: statistics.median(ts) for name, ts in times.items()},
        "tb_per_s": {name: moved / statistics.median(ts) / 1e12 for name, ts in times.items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": _triton_version(), "commit": commit(),
        "command": "python3 packages/moe-precision/bench/cast_bandwidth.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
    }
    result["ratio_triton_over_torch"] = result["tb_per_s"]["triton_upcast"] / result["tb_per_s"]["torch_to"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
