"""The LM head and loss, whole logits against train.loss_chunk_tokens chunks: time and peak memory on one GPU.

    python3 packages/moe-train/bench/bench_chunked_loss.py --out packages/moe-train/bench/results/h100_chunked_loss.json

What is timed is what a training step runs for the head: the recipe's linear head (fp32 weight, bf16 autocast) on the
final hidden states, the cross-entropy, and backward into the hidden states and the head's weight. Shapes are the
presets' heads at their micro-batch: olmo-core-8l (16,384 tokens, d 4096, vocab 100,352) and fine-grained
(8,192 tokens, d 2048, vocab 50,304). Methods alternate within each round (round-robin), and the best round's
median counts. Peak memory is torch.cuda.max_memory_allocated over one forward+backward, less what was allocated
before it (the hidden states, the weight, its gradient buffer). The chunked loss's values are checked against the
whole-logits loss first (loss, both gradients).

`--z-loss-weights 0,1e-5` adds the LM head's z-loss (train.lm_z_loss_weight) as more methods in the same rounds:
a method is a chunk size (0 = whole logits) and a weight, keyed "4096" without a z-loss and "4096+z" with one. The
whole logits with a z-loss run compiled, as Transformer.loss_terms runs them on a GPU; "0+z eager" times the eager
terms beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from moe_precision import PrecisionRecipe
from moe_train.model.chunked_loss import chunked_head_losses
from moe_train.model.transformer import compiled_head_losses, head_losses

SHAPES = {"olmo-core-8l": (16384, 4096, 100_352), "fine-grained": (8192, 2048, 50_304)}


EAGER = -1  # the "chunk" of the whole logits with eager z-loss terms


def _step(h: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, method: tuple[int, float]) -> torch.Tensor:
    """One forward+backward of the head and its loss; the objective (cross-entropy + z-loss term) comes back."""
    chunk, z_weight = method
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if chunk > 0:
            ce, z = chunked_head_losses(h, head.gemm_weight(h), targets, chunk, z_weight)
        else:  # as Transformer.loss_terms on a GPU: the terms compiled with a z-loss, F.cross_entropy without one
            losses = compiled_head_losses() if z_weight and chunk == 0 else head_losses
            ce, z = losses(head(h), targets, z_weight)
    (ce + z).backward()
    return (ce + z).detach()


def _key(method: tuple[int, float]) -> str:
    if method[0] == EAGER:
        return "0+z eager"
    return f"{method[0]}+z" if method[1] else str(method[0])


def _peak_gib(h, head, targets, method) -> float:
    torch.cuda.synchronize()
    head.weight.grad = None
    h.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _step(h, head, targets, method)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _check(h, head, targets, methods) -> dict:
    """Each chunked (and the eager whole-logits) method against the whole logits with the same z-loss weight."""
    out = {}
    for chunk, z_weight in methods:
        if chunk == 0:
            continue
        h.grad = head.weight.grad = None
        want = _step(h, head, targets, (0, z_weight))
        want_h, want_w = h.grad.clone(), head.weight.grad.clone()
        h.grad = head.weight.grad = None
        got = _step(h, head, targets, (chunk, z_weight))
        rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        out[_key((chunk, z_weight))] = {"loss_abs": abs(float(got - want)), "grad_h_rel": rel(h.grad, want_h),
                                        "grad_w_rel": rel(head.weight.grad, want_w)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--z-loss-weights", default="0")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    z_weights = [float(z) for z in a.z_loss_weights.split(",")]
    methods = [(c, z) for z in z_weights for c in [0] + chunks] + [(EAGER, z) for z in z_weights if z]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "z_loss_weights": z_weights,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip() or "unknown", "shapes": {}}
    for name, (n, d, v) in SHAPES.items():
        torch.manual_seed(0)
        head = PrecisionRecipe("bf16").linear(d, v).cuda()
        torch.nn.init.normal_(head.weight, std=0.02)
        h = torch.randn(n, d, device="cuda", requires_grad=True)
        targets = torch.randint(0, v, (n,), device="cuda")
        targets[:: 97] = -100
        entry = {"tokens": n, "d": d, "vocab": v, "check": _check(h, head, targets, methods), "ms": {}, "peak_gib": {}}
        for m in methods:
            entry["peak_gib"][_key(m)] = round(_peak_gib(h, head, targets, m), 3)
        best = {m: float("inf") for m in methods}
        for _ in range(a.rounds):
            for m in methods:
                times = []
                for _ in range(a.iters):
                    h.grad = head.weight.grad = None
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    _step(h, head, targets, m)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                best[m] = min(best[m], statistics.median(times))
        entry["ms"] = {_key(m): round(t, 3) for m, t in best.items()}
        flops = 6 * n * d * v
        entry["tflops"] = {_key(m): round(flops / (t * 1e-3) / 1e12, 1) for m, t in best.items()}
        result["shapes"][name] = entry
        print(name, json.dumps({k: entry[k] for k in ("ms", "tflops", "peak_gib")}), flush=True)
        print(name, "check", json.dumps(entry["check"]), flush=True)
        del head, h, targets
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
