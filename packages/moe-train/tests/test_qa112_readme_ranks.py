"""The READMEs' multi-rank ```python blocks, run as `torchrun --nproc-per-node N` runs them (QA 112).

test_qa55_readme.py runs every other README block in one process and classifies these three "multi-rank"; here
each runs on real gloo ranks, as many as its README implies, every rank given what torchrun sets (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: test_parallel_harness.worker_env) and executing the block's
text, read from the README. The ranks are forked from test_parallel_harness's forkserver (torch imported once)
rather than started as torchrun's fresh interpreters: 8 of those importing torch took 10 s (19 s of CPU) on
2 cores before any work; the 8-rank test takes ~8 s in all.

What the README leaves to the reader (a model, its data, `write` / `read`, a rank's local tensors) is defined in
a prelude before the block. Substitutions, each one what a CPU job needs:
  - moe-ckpt: the global shapes (64, 2048, 1024) -> (64, 2, 3) and (2048, 2048) -> (8, 6) (0.55 GB of fp32 in the
    README; the expert dim, 8 experts per EP rank over 8 ranks, is kept). The block calls `dist.barrier` and
    `dist.new_group` on a default group it leaves to the reader to start: the prelude's
    `dist.init_process_group("gloo")`, from torchrun's environment.
  - moe-parallel: none. The block starts gloo itself (`# or nccl`), and its model is built on the CPU.
    The optimizer block runs in two parts, split at its blank line (save | load): between them the test keeps
    what was saved, overwrites the optimizer state and the weights with NaN and zeroes the step counts, as a
    fresh job would hold other values, then `dist.barrier()` (a real save and load are separate jobs; run as
    one job, a rank would read before the others had written).
"""

from __future__ import annotations

import ast
import math
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import qa112_worker as w
import test_parallel_harness as h
from test_qa55_readme import readme_blocks

PARALLEL_BLOCK = ("moe-parallel", "import torch.distributed as dist")
OPTIMIZER_BLOCK = ("moe-parallel",
                   "for p in opt.state_pieces():              # save: each element once, by the rank that owns it")
CKPT_BLOCK = ("moe-ckpt", "from datetime import timedelta")
CKPT_SHAPES = {"(64, 2048, 1024)": "(64, 2, 3)", "(2048, 2048)": "(8, 6)"}
DEADLINE_S = 60  # ~3 s and ~8 s when they pass


def block(pkg: str, first_line: str) -> str:
    found = [code for p, code in (b.values for b in readme_blocks())
             if p == pkg and code.splitlines()[0].strip() == first_line]
    assert len(found) == 1, f"{pkg} README: {len(found)} python blocks start with {first_line!r}"
    return found[0]


# ---- moe-parallel: ParallelLayout(dp=4, ep=2) on 4 ranks, then its optimizer's state pieces -------------------
def one_process_grad_norm() -> float:
    """The norm of the global gradient on one process: every rank's tokens, all 8 experts."""
    model = w.readme_model()
    batches = w.global_batches()
    for t in batches:
        (w.loss_fn(model, t[:, :-1], t[:, 1:]) / len(batches)).backward()
    return float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())


def test_moe_parallel_blocks_on_4_ranks(tmp_path):
    res = spawn(w.parallel_rank, w.WORLD_PARALLEL, tmp_path, block(*PARALLEL_BLOCK), block(*OPTIMIZER_BLOCK))
    # "OptimizerStepResult(grad_norm, skipped)": one global norm, the same on every rank, the one-process norm
    assert all(r["type"] == "OptimizerStepResult" and not r["skipped"] for r in res), res
    assert len({r["grad_norm"] for r in res}) == 1, [r["grad_norm"] for r in res]
    want = one_process_grad_norm()
    assert math.isclose(res[0]["grad_norm"], want, rel_tol=1e-5), (res[0]["grad_norm"], want)
    # "all-gather": after the step, dense weights equal on all 4 ranks, each expert slice on its 2 replicas
    initial = dict(w.readme_model().named_parameters())
    for name, weight in res[0]["weights"].items():
        holders = [r for r in res if r["ep_rank"] == 0] if name in res[0]["shards"] else res
        assert all(torch.equal(r["weights"][name], weight) for r in holders), name
    assert not torch.equal(res[0]["weights"]["embed.weight"], initial["embed.weight"].detach())


# ---- moe-ckpt: Box.dim0 over 8 EP ranks --------------------------------------------------------------------
def test_moe_ckpt_block_on_8_ranks(tmp_path):
    code = block(*CKPT_BLOCK)
    for big, small in CKPT_SHAPES.items():
        assert big in code, f"moe-ckpt README block no longer has the shape {big}: update CKPT_SHAPES"
        code = code.replace(big, small)
    res = spawn(w.ckpt_rank, w.WORLD_CKPT, tmp_path, code)
    shard_files = [f for f in res[0]["files"] if f.endswith(".safetensors")]
    assert len(shard_files) == w.WORLD_CKPT, res[0]["files"]


# ---- ranks ---------------------------------------------------------------------------------------------------
def spawn(body, world: int, tmp_path: Path, *blocks: str) -> list[dict]:  # noqa: ANN001
    for code in blocks:
        ast.parse(code)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    # h.start_ranks, with a deadline: a block that fails on some ranks only leaves the others waiting in a
    # collective or in init_process_group's rendezvous for torch's default timeout (30 minutes)
    context = mp.start_processes(w.rank_main, args=(world, h.free_port(), str(work), str(out), body, *blocks),
                                 nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            errors = {f.name: torch.load(f, weights_only=False).get("error") for f in sorted(out.glob("rank*.pt"))}
            pytest.fail(f"{world} ranks not done within {DEADLINE_S} s; the ranks that ended said: {errors}")
    return h.load_results(out, world)
