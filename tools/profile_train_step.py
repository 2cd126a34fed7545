"""Profile training steps of a preset: where a step's GPU time goes, by kernel family and operator.

usage (GPU machine, repo root, after `source tools/gpu_env.sh`; on a CPU it profiles CPU time per operator):
    python3 tools/profile_train_step.py --preset fine-grained-e8 [--steps 2] [--warmup 3] [--out F.json]
        [any moe-train override, e.g. --train.activation_checkpointing=full]

Runs the path `moe-train bench` runs (same runtime, synthetic tokens), then profiles `--steps`
optimizer steps with torch.profiler and prints: the step's wall time, GPU busy time, GPU time per
kernel family (GEMM, attention, Triton, optimizer, elementwise/reduction, copies, collectives) and
the top kernels by GPU time, the host time of CUDA runtime calls (a sync stands out there). --out writes the
same as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from moe_train.bench import synthetic_steps
from moe_train.config_io import build_config, parse_overrides

FAMILIES = (  # first match wins
    ("collective", r"nccl|allreduce|all_to_all|alltoall"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("gemm", r"gemm|cutlass|nvjet|sm90_xmma|matmul|grouped_mm|_mm_|cublas"),
    ("triton", r"^triton|_kernel$"),
    ("copy", r"memcpy|memset|copy"),
    ("elementwise", r"."),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "elementwise"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    args, overrides = ap.parse_known_args(argv)
    cfg = build_config(args.preset, None, parse_overrides(overrides))
    runtime, one_step = synthetic_steps(cfg)  # the path `moe-train bench` times
    device = runtime.device
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for i in range(args.warmup):
        one_step(i)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(args.steps):
            one_step(args.warmup + i)
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    runtime.close()
    per_kernel: dict[str, float] = defaultdict(float)  # GPU kernels: ms per step
    count: dict[str, int] = defaultdict(int)
    api: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # CUDA runtime/driver calls: host ms, count
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time / 1e3 / args.steps
            count[ev.name] += 1
        elif ev.name.startswith("cu"):
            api[ev.name][0] += ev.cpu_time_total / 1e3 / args.steps
            api[ev.name][1] += 1
    fams: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        fams[family(name)] += ms

    def self_ms(e) -> float:  # an operator's own time: on the GPU when there is one
        return (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3 / args.steps

    ops = sorted(((e.key, self_ms(e), e.count // args.steps) for e in prof.key_averages() if self_ms(e) > 0),
                 key=lambda r: -r[1])[: args.top]
    report = {
        "preset": args.preset, "overrides": overrides, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "step_wall_ms_profiled": wall_ms,
        "gpu_busy_ms": sum(per_kernel.values()) if cuda else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
        "cuda_api_host_ms": {n: [round(v[0], 3), v[1] // args.steps]
                             for n, v in sorted(api.items(), key=lambda kv: -kv[1][0])[: args.top]},
        "top_ops": [{"op": k, "ms": round(ms, 3), "calls": c} for k, ms, c in ops],
        "top_kernels": [{"name": n[:140], "ms": round(ms, 3), "calls": count[n] // args.steps}
                        for n, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]],
    }
    busy = report["gpu_busy_ms"]
    print(f"{args.preset} {' '.join(overrides)}: step {wall_ms:.1f} ms wall (profiled)"
          + (f", GPU busy {busy:.1f} ms, peak {report['peak_mem_gib']:.1f} GiB" if cuda else ""))
    for fam, ms in report["families_ms"].items():
        print(f"  {fam:12s} {ms:8.2f} ms  {ms / busy:6.1%}")
    for k in report["top_kernels"]:
        print(f"  {k['ms']:8.3f} ms  x{k['calls']:<4d} {k['name']}")
    if report["cuda_api_host_ms"]:
        print("  CUDA API calls (host ms per step, calls):", report["cuda_api_host_ms"])
    print(f"  by operator (self {'GPU' if cuda else 'CPU'} time):")
    for o in report["top_ops"]:
        print(f"  {o['ms']:8.3f} ms  x{o['calls']:<4d} {o['op']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
