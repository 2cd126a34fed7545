"""`moe-train bench`: N training steps of a preset on synthetic tokens, reported as JSON."""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe_train.config import Config, ConfigError
from moe_train.model import Transformer, count_params, flops_per_token
from moe_train.trainer.aborted_backward import release_aborted_backward
from moe_train.trainer.ctrl_c import CtrlCWatch
from moe_train.trainer.launch import make_runtime, pick_device
from moe_train.trainer.metrics import max_over_ranks
from moe_train.trainer.mfu import run_peak_tflops
from moe_train.trainer.runtime import Runtime


BENCH_EOS_ID = 0  # the end-of-document id of the synthetic tokens under train.document_masking


def source_commit() -> str | None:
    """The git commit of the source this module runs from, "-dirty" when tracked files differ from it; None
    outside a git work tree (an installed wheel) or without git. Recorded in the JSON so that a result file names
    the code that made it (several committed results had none)."""
    here = str(Path(__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        changed = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if changed.returncode:  # cannot tell whether the tree is clean: no commit rather than a wrong one
        return None
    return head.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")


def synthetic_steps(cfg: Config) -> tuple[Runtime, Callable[[int], float]]:
    """The runtime `train` would use for cfg, with the model set up on it, and `one_step(i)`: optimizer
    step i on synthetic tokens along the trainer's path (runtime.backward per micro-batch under the
    trainer's autocast, then runtime.step: clip + AdamW), returning the last micro-batch's loss."""
    t, m = cfg.train, cfg.model
    torch.manual_seed(t.seed)
    runtime = make_runtime(cfg, pick_device(t.device))
    device = runtime.device
    model = runtime.setup(Transformer(m, device="meta"))
    seq, mb = cfg.data.seq_len, t.micro_batch_size
    amp = device.type == "cuda" and t.autocast_bf16
    g = torch.Generator(device="cpu").manual_seed(t.seed)
    batches = [torch.randint(0, m.vocab_size, (mb, seq + 1), generator=g) for _ in range(4)]
    if t.document_masking:  # synthetic documents of seq_len // 4 tokens: BENCH_EOS_ID ends each
        doc = max(seq // 4, 1)
        for b in batches:
            b[:, doc::doc] = BENCH_EOS_ID
    # the kernel serves the windowed layers (model.sliding_window_pattern) too, with or without documents
    model.set_document_masking(BENCH_EOS_ID if t.document_masking else None, t.document_masking_kernel)

    def one_step(i: int) -> float:
        for micro in range(t.grad_accum):
            b = batches[(i * t.grad_accum + micro) % len(batches)].to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                ce, aux = model.loss(b[:, :-1], b[:, 1:])
            runtime.backward((ce + aux) / t.grad_accum, last_micro_batch=micro == t.grad_accum - 1)
        runtime.step(t.lr)
        return float(ce.detach())

    return runtime, one_step


def run_bench(cfg: Config, steps: int, warmup: int) -> dict[str, Any]:
    """Time `steps` optimizer steps after `warmup`; routing as configured (presets use random routing).

    The runtime is the one `train` would use for this config (`parallel.*`: e.g. bf16 resident
    weights, or a layout under torchrun). tokens_per_s, model_tflops and mfu are this rank's (per GPU);
    tokens_per_s_all_ranks is every rank's tokens over the slowest rank's time, and peak_mem_gib the
    largest over the ranks. Under torchrun only rank 0 prints and writes --out (the CLI)."""
    if steps < 1:
        raise ConfigError(f"bench --steps={steps}: expected a positive integer")
    if warmup < 0:
        raise ConfigError(f"bench --warmup={warmup}: expected an integer >= 0")
    t, m = cfg.train, cfg.model
    runtime, one_step = synthetic_steps(cfg)
    device = runtime.device
    attention_dtype = (torch.bfloat16 if device.type == "cuda" and t.autocast_bf16
                       else next(runtime.model.parameters()).dtype)
    seq, mb = cfg.data.seq_len, t.micro_batch_size
    try:  # the process group is closed however the run ends (a kernel refused here too)
        with CtrlCWatch():  # SIGTERM as Ctrl-C (a scheduler stopping the job): one line, not a silent death
            masking_path = runtime.model.document_masking_path(device, attention_dtype)  # "flex" / "sdpa" / None
            for i in range(warmup):
                one_step(i)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            loss = 0.0
            for i in range(steps):
                loss = one_step(warmup + i)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            # the slowest rank's time and the largest peak memory over the job
            slowest, peak_mem_max = max_over_ranks([elapsed, peak_mem or 0.0], runtime.rank, runtime.world_size,
                                                   runtime.all_reduce_sum, runtime.device)
    except BaseException:
        release_aborted_backward()  # a backward cut short: its queued nodes freed now, not in a crash at exit
        raise
    finally:
        runtime.close()
    peak_mem_max = peak_mem_max if peak_mem is not None else None
    tokens = steps * t.grad_accum * mb * seq
    tps = tokens / elapsed
    fpt = flops_per_token(m, seq)
    peak = run_peak_tflops(cfg, device)  # None (no MFU) for fp32 GEMMs
    counts = count_params(m)
    return {
        "preset": cfg.preset, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "commit": source_commit(), "steps": steps, "warmup": warmup,
        "tokens_per_step": tokens // steps,
        "step_ms": elapsed / steps * 1e3, "tokens_per_s": tps, "model_tflops": fpt * tps / 1e12,
        "mfu": (fpt * tps / 1e12 / peak) if peak else None, "peak_tflops_bf16": peak,
        "peak_mem_gib": peak_mem_max,
        "params_total": counts.total, "params_active": counts.active, "flops_per_token": fpt,
        "routing": m.router.routing, "final_loss": loss, "runtime": type(runtime).__name__,
        "world_size": runtime.world_size, "param_dtype": cfg.parallel.param_dtype,
        "activation_checkpointing": t.activation_checkpointing, "compile": t.compile,
        "loss_chunk_tokens": t.loss_chunk_tokens, "lm_z_loss_weight": t.lm_z_loss_weight,
        "seq_len": seq, "sliding_window_pattern": list(m.sliding_window_pattern),
        "document_masking": t.document_masking,
        "document_masking_kernel": t.document_masking_kernel, "document_masking_path": masking_path,
        # every rank's tokens over the slowest rank's time (pp=1: each rank trains on its own tokens)
        "tokens_per_s_all_ranks": tokens * runtime.world_size / slowest,
        "rank": runtime.rank,
    }
