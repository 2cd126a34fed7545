"""Shared test state and layouts (imported by the tests, the gloo workers and the crash subprocess)."""

from __future__ import annotations

import gc
import json
import math
import struct
import threading
from pathlib import Path

import torch

from moe_ckpt import Box, FlatRange, LoadRequest, ShardSpec, even_split
from moe_ckpt.shard_file import file_checksum



def start_forked(process) -> None:  # noqa: ANN001 - a multiprocessing fork-context Process
    """process.start(), with the parent's objects kept from the child's garbage collector (gc.freeze). A forked child
    inherits this pytest worker's garbage, earlier tests' gloo process groups among it; collecting one there joins
    threads the child does not have (a hang on this machine; a SIGSEGV in a forked gloo rank in CI)."""
    gc.collect()
    gc.freeze()
    try:
        process.start()
    finally:
        gc.unfreeze()


# name -> (global shape, dtype); covers EP stacks, replicated, ZeRO flat, bf16, scalar, empty
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "experts.w1": ((8, 6, 5), torch.float32),
    "attn.w": ((7, 5), torch.float32),
    "opt.exp_avg.attn.w": ((7, 5), torch.float32),
    "opt.exp_avg.experts.w1": ((8, 6, 5), torch.float32),
    "norm.b": ((3,), torch.bfloat16),
    "step": ((), torch.int64),
    "empty": ((0, 4), torch.float32),
}


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in SPECS.items():
        if dtype == torch.int64:
            out[name] = torch.randint(0, 10_000, shape, generator=g)
        else:
            t = torch.randn(shape, generator=g)
            if t.numel() > 2:  # values where "close" is not "identical"
                t.view(-1)[0], t.view(-1)[1] = float("nan"), -0.0
            out[name] = t.to(dtype)
    return out


def shards_for(state: dict[str, torch.Tensor], rank: int, world: int) -> list[ShardSpec]:
    """Training layout: experts split along dim 0 (EP), params replicated (rank 0 writes),
    optimizer state and the bias in ZeRO-style flat ranges, scalar replicated."""
    out = []
    for name, t in state.items():
        shape = tuple(t.shape)
        if name == "experts.w1" or name == "empty":
            off, n = even_split(shape[0], rank, world)
            out.append(ShardSpec(name, shape, t[off : off + n], Box.dim0(shape, off, n)))
        elif name.startswith("opt.") or name == "norm.b":
            off, n = even_split(t.numel(), rank, world)
            out.append(ShardSpec(name, shape, t.reshape(-1)[off : off + n], FlatRange(off, n)))
        else:
            out.append(ShardSpec(name, shape, t, writer=rank == 0))
    return out


def requests_for(rank: int, world: int, style: str) -> list[LoadRequest]:
    """A load layout: "dim0" (rows split over world), "flat" (1-D ranges), "whole"."""
    out = []
    for name, (shape, dtype) in SPECS.items():
        if style == "whole" or not shape:
            region = None
        elif style == "dim0":
            region = Box.dim0(shape, *even_split(shape[0], rank, world))
        else:
            region = FlatRange(*even_split(math.prod(shape), rank, world))
        out.append(LoadRequest(name, shape, dtype, region))
    return out


def expected(state: dict[str, torch.Tensor], req: LoadRequest) -> torch.Tensor:
    t = state[req.name]
    if req.region is None:
        return t
    if isinstance(req.region, FlatRange):
        return t.reshape(-1)[req.region.start : req.region.start + req.region.length]
    return t[req.region.slices()]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN == NaN, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def check_load(state: dict[str, torch.Tensor], got: dict[str, torch.Tensor], reqs: list[LoadRequest]) -> None:
    for r in reqs:
        assert bits_equal(got[r.name], expected(state, r)), f"{r.name} {r.region} differs"


def run_ranks(world: int, fn) -> list:
    """Run fn(rank, barrier) for every rank on its own thread (ranks simulated in one process)."""
    bar = threading.Barrier(world, timeout=60)
    results, errors = [None] * world, []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, bar.wait)
        except BaseException as e:
            errors.append(e)
            bar.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results


def reseal(ck) -> None:
    """Make index.json's sizes and checksums match the files again, as a tool that rewrote them would."""
    idx = json.loads((ck / "index.json").read_text())
    for fname, rec in idx["files"].items():
        got = file_checksum(ck / fname, idx["checksum_algorithm"])
        rec["bytes"], rec["checksum"] = got.nbytes, got.checksum
    (ck / "index.json").write_text(json.dumps(idx))


def edit_header(path, key: str, **fields) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header[key].update(fields)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n :])


def free_port() -> int:
    """A TCP port nothing listens on, for a process group's store, drawn at random below the kernel's ephemeral
    range. A port-0 pick (the kernel's, closed and bound again later by the store) could be handed in between to a
    port-0 bind of another process, the other pytest worker's gloo listeners among them, leaving the ranks waiting
    for a store that is not theirs (review helper 169); the kernel never hands out a port below that range."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range's start, where most kernels begin
        low = 49152
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))  # as the store binds it: every address
            except OSError:  # taken: draw again
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port found in [10000, {low})")


# moe-train's ModelConfig as a dict, 2 layers, for the HF tests (test_hf_sliding_window's own cannot be imported:
# moe-train's tests hold a module of that name too)
HF_ROUTER = dict(gating="softmax", top_k=2, normalize_top_k=True, routing="learned", lb_loss_weight=0.01,
                 lb_loss_scope="micro_batch", z_loss_weight=0.001, expert_bias=False, expert_bias_rate=0.001,
                 routed_scaling_factor=1.0)
HF_MODEL = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=None, qk_norm=True,
                attention_bias=False, rope_theta=1000.0, rotary_fraction=1.0, sliding_window_pattern=[], norm_eps=1e-6,
                dense_hidden=48, dense_layers=[], num_experts=4, expert_hidden=16, shared_expert_hidden=0,
                shared_expert_gate=False, router=HF_ROUTER, tie_embeddings=False, init_std=0.02, gemm_backend="auto",
                precision="bf16")
