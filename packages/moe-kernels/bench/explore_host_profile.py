"""Host time of one block call, function by function (cProfile): what the host does while an idle GPU waits at the
start of a call (explore_call_gaps.py: 0.3-0.6 ms between the route map's last kernel and the permute).

    PYTHONPATH=packages/moe-kernels/src python3 packages/moe-kernels/bench/explore_host_profile.py --shape a --experts 128
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from bench_moe_block import SHAPES, make_inputs
from host_timeline import phases_ours


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="a")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    s = SHAPES[args.shape]
    ids, weights, x, w1, w2, gy = make_inputs(s["T"], s["d"], s["h"], s["k"], args.experts, 0)
    for t in (x, weights, w1, w2):
        t.requires_grad_()
    E = args.experts
    args_ = (ids, weights, x, w1, w2, gy)
    for _ in range(3):  # warm-up: compiles, and times the block's plans once
        phases_ours(args_, E)

    def host_phases(prof: cProfile.Profile | None) -> dict[str, list[float]]:
        """host_timeline.phases_ours per call from an idle GPU, under `prof` when given."""
        phases: dict[str, list[float]] = {}
        for _ in range(args.calls):
            torch.cuda.synchronize()
            if prof is not None:
                prof.enable()
            for k, v in phases_ours(args_, E).items():
                phases.setdefault(k, []).append(v)
            if prof is not None:
                prof.disable()
        torch.cuda.synchronize()
        return phases

    prof = cProfile.Profile()
    host = host_phases(prof)
    clean = host_phases(None)  # host time per phase without the profiler
    for label, d in (("host ms, no profiler", clean), ("host ms, under cProfile", host)):
        print(label + ": " + ", ".join(f"{k} {sorted(v)[len(v) // 2] * 1e3:.3f}" for k, v in d.items()))
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(35)
        print(f"--- by {key} ({args.calls} calls)")
        print(out.getvalue())


if __name__ == "__main__":
    main()
