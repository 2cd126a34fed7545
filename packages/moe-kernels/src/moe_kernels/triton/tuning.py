"""Per-shape block-shape choice for the triton kernels, cached in a process-wide dict.

The first call for a key times every candidate (triton.testing.do_bench, median) and keeps
the fastest; later calls reuse it. Tuning is skipped, taking the first candidate, on the CPU
(interpreter) and while a CUDA graph is being captured, so capture a graph after a warm-up.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_BEST: dict[tuple, dict[str, Any]] = {}


def rows_bucket(n: int) -> int:
    """n rounded up to a power of two: the row count in tuning keys. Expert-parallel ranks
    receive a different number of rows every step; the best block shape barely depends on it,
    and an exact count in the key would re-tune every step."""
    return 1 << max(0, n - 1).bit_length()


def _unbuildable(exc: Exception) -> bool:
    """A candidate that does not fit (shared memory, registers) or that the compiler rejects (a
    warp-specialisation pass failure): the tuner skips it. The first candidate must always build."""
    text = str(exc)
    return "out of resource" in text.lower() or "OutOfResources" in type(exc).__name__ or "PassManager::run failed" in text


def pick_config(key: tuple, configs: list[dict[str, Any]], launch: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run `launch` with the cached best config for `key`, tuning first if it is new. Returns the config."""
    best = _BEST.get(key)
    if best is None:
        if len(configs) == 1 or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
            best = configs[0]
        else:
            import triton.testing

            times = []
            for cfg in configs:
                try:
                    launch(cfg)  # compile outside the timing
                    times.append(triton.testing.do_bench(lambda cfg=cfg: launch(cfg), warmup=5, rep=20, return_mode="median"))
                except Exception as exc:
                    if not _unbuildable(exc):
                        raise
                    times.append(float("inf"))
            best = configs[min(range(len(configs)), key=times.__getitem__)]
        _BEST[key] = best
    launch(best)
    return best


def tuned_configs() -> dict[tuple, dict[str, Any]]:
    """The block shapes chosen so far, per key (for benchmark reports)."""
    return dict(_BEST)
