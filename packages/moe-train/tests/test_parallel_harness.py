"""Shared pieces of the multi-process parallel tests: a shrunk tiny preset, a minimal loop, spawn helpers.

Each worker is a real process group over gloo (torch.multiprocessing.spawn); results come back
as torch.save files. Several checks are batched into one spawn because a 4-rank spawn is costly.
"""

from __future__ import annotations

import gc
import os
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore

from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig
from moe_train.data import WindowSampler
from moe_train.model import Transformer
from moe_train.presets import tiny
from moe_train.trainer.schedule import lr_at

GLOBAL_BATCH = 8  # sequences per micro-batch over all data-parallel ranks
STEPS = 20
GRAD_ACCUM = 2


def shrunk_tiny(dp: int = 1, ep: int = 1, strategy: str = "ddp") -> Config:
    """The tiny preset made smaller for speed, fp32 on CPU, global-scope balancing loss (exact under DP)."""
    cfg = tiny()
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.dense_hidden, m.expert_hidden = 256, 32, 3, 64, 32
    m.router.lb_loss_scope = "global"
    cfg.data.seq_len = 16
    t = cfg.train
    t.micro_batch_size, t.grad_accum, t.steps, t.warmup_steps, t.device = GLOBAL_BATCH // dp, GRAD_ACCUM, STEPS, 5, "cpu"
    cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.strategy = dp, ep, strategy
    return cfg


def small_config(tmp_path, **train) -> Config:
    """A very small MoE for fast CPU tests, on a small data folder made by the `data_dir` fixture."""
    return Config(
        model=ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True,
                          dense_hidden=64, dense_layers=[0], num_experts=4, expert_hidden=16,
                          shared_expert_hidden=16, router=RouterConfig(top_k=2, expert_bias=True)),
        data=DataConfig(path=str(tmp_path / "data"), seq_len=32),
        train=TrainConfig(**{"steps": 6, "micro_batch_size": 4, "grad_accum": 2, "warmup_steps": 2,
                             "eval_interval": 3, "eval_windows": 8, "log_interval": 2, "save_interval": 3,
                             "run_dir": str(tmp_path / "run"), "progress": False, **train}),
        preset="test",
    )


def token_stream(seed: int = 0, n: int = 40_000, vocab: int = 256) -> np.ndarray:
    """A learnable synthetic stream: a noisy repeating pattern."""
    rng = np.random.default_rng(seed)
    base = np.tile(rng.integers(0, vocab, 97), n // 97 + 1)[:n]
    noise = rng.random(n) < 0.1
    return np.where(noise, rng.integers(0, vocab, n), base).astype(np.int32)


def train(cfg: Config, runtime, tokens: np.ndarray, on_micro_batch=None) -> dict:  # noqa: ANN001
    """Minimal loop over the Runtime calls (the same ones moe_train's loop makes). Returns losses and weights."""
    t = cfg.train
    torch.manual_seed(t.seed)
    model = runtime.setup(Transformer(cfg.model, device="meta"))
    sampler = WindowSampler(tokens, cfg.data.seq_len, cfg.data.seed)
    losses, norms = [], []
    for step in range(t.steps):
        ce_sum = torch.zeros(())
        for micro in range(t.grad_accum):
            x, y = sampler.next_batch(t.micro_batch_size, runtime.dp_rank, runtime.dp_size)
            ce, aux = model.loss(x, y)
            last = micro == t.grad_accum - 1
            if on_micro_batch is not None:
                on_micro_batch("begin", last)
            runtime.backward((ce + aux) / t.grad_accum, last_micro_batch=last)
            if on_micro_batch is not None:
                on_micro_batch("end", last)
            ce_sum += ce.detach()
        result = runtime.step(lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio))
        for _, router in model.routers():
            router.update_expert_bias(runtime.all_reduce_sum(router.step_load.clone()))
        losses.append(float(runtime.all_reduce_sum(ce_sum / (t.grad_accum * runtime.dp_size))))
        norms.append(result.grad_norm)
    return {"losses": losses, "norms": norms, "model": model}


def global_weights(runtime, model) -> dict[str, tuple]:  # noqa: ANN001
    """This rank's model-weight pieces: name -> (global shape, per-dim slice, tensor)."""
    if getattr(runtime, "optimizer", None) is None:  # local or FSDP2: whole (DTensor -> full) tensors
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
        return {n: (tuple(p.shape), tuple((0, s) for s in p.shape), p) for n, p in full.items()}
    return {s.global_name: (s.global_shape, s.slice, s.tensor.detach().clone())
            for s in runtime.checkpoint_shards() if not s.global_name.startswith("optim.")}


def assemble(pieces: list[dict[str, tuple]]) -> dict[str, torch.Tensor]:
    """Stitch per-rank weight pieces into global tensors."""
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in pieces:
        for name, (shape, dims, tensor) in rank_pieces.items():
            full = out.setdefault(name, torch.full(shape, float("nan")))
            full[tuple(slice(o, o + n) for o, n in dims)] = tensor
    return out


# Ranks are forked from a server that has imported these once: a freshly spawned interpreter spends ~3 s of CPU
# importing torch and the packages, on every rank of every multi-rank test (CI has 2 cores). What a rank needs
# travels as its arguments: a forked rank does not see environment variables set in the test process after the
# server started.
mp.set_forkserver_preload(["torch", "torch.distributed", "moe_kernels", "moe_parallel", "moe_ckpt", "moe_train"])


def start_ranks(fn, args: tuple, nprocs: int) -> None:  # noqa: ANN001
    """torch.multiprocessing.spawn(fn, args, nprocs, join=True), the ranks started by the forkserver."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


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


def worker_env(rank: int, world: int, port: int) -> None:
    """What torchrun would set; make_runtime (the CLI edge) reads it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def run_guarded(rank: int, fn, out_dir: str, *args) -> None:  # noqa: ANN001
    """Run fn(rank, *args) -> dict and save it (or the traceback) to out_dir/rank{r}.pt."""
    try:
        result = fn(rank, *args)
    except BaseException:  # noqa: BLE001 - the parent reports it
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    del result
    release_process_groups()


def release_process_groups() -> None:
    """End a spawned rank with no process group alive. A group that outlives its rank's work (not destroyed, or
    held by a reference cycle the garbage collector has not reached) keeps gloo's worker threads running into
    interpreter exit, where one still releasing a collective's tensors takes the GIL and aborts the rank with
    SIGABRT ("terminate called without an active exception", pytorch#190489), after its results were saved."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # a group freed here has its threads joined while the interpreter is whole


def spawn_jobs(worker, world: int, jobs: list, out_dir: Path,  # noqa: ANN001
               host_stores: list[bool] | None = None) -> list[dict]:
    """worker(rank, world, ports, jobs, out_dir) on `world` ranks, one free port per job; every rank's results.
    host_stores[i]: this process hosts job i's TCPStore on its port while the ranks run, as torchrun's agent hosts
    its rendezvous store (every rank a client, the store outliving them all); the worker connects to it as a
    client. Otherwise the worker's rank 0 hosts it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in jobs]
    hosted = [TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
              for port, host in zip(ports, host_stores or [False] * len(jobs)) if host]
    start_ranks(worker, args=(world, ports, jobs, str(out_dir)), nprocs=world)
    del hosted
    return load_results(out_dir, world)


def load_results(out_dir: Path, world: int) -> list[dict]:
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


# ---- workers (run inside spawned processes) -------------------------------------------------
INVALID_LAYOUTS = [  # (dp, ep, num_experts) on a world of 4
    (2, 1, 8),  # dp * pp != world size
    (4, 3, 6),  # ep does not divide dp
    (4, 4, 6),  # ep does not divide the expert count
]
COUNTED = ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor", "all_to_all_single", "broadcast")


def _invalid_layout_messages() -> list[str]:
    from moe_train.trainer.launch import make_runtime

    messages = []
    for dp, ep, experts in INVALID_LAYOUTS:
        cfg = shrunk_tiny(dp, ep)
        cfg.model.num_experts = experts
        try:
            make_runtime(cfg, torch.device("cpu"))
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def _run(cfg: Config, tokens: np.ndarray, on_micro_batch=None) -> dict:  # noqa: ANN001
    from moe_train.trainer.launch import make_runtime

    rt = make_runtime(cfg, torch.device("cpu"))
    res = train(cfg, rt, tokens, on_micro_batch)
    opt = getattr(rt, "optimizer", None)
    return {"losses": res["losses"], "norms": res["norms"], "weights": global_weights(rt, res["model"]),
            "state_bytes": opt.state_bytes() if opt is not None else None,
            "reduced_buckets": sum(len(f.buckets) for f in opt.flats if f.group_size > 1) if opt is not None else None,
            "num_params": sum(p.numel() for p in Transformer(cfg.model).parameters())}


def worker4(rank: int, port: int, tokens: np.ndarray) -> dict:
    worker_env(rank, 4, port)
    out = {"invalid": _invalid_layout_messages()}  # before any process group exists
    for dp, ep in ((4, 1), (4, 2), (4, 4)):
        out[f"dp{dp}_ep{ep}"] = _run(shrunk_tiny(dp, ep), tokens)
    torch.distributed.destroy_process_group()
    return out


def worker2(rank: int, port: int, tokens: np.ndarray) -> dict:
    import torch.distributed as dist

    worker_env(rank, 2, port)
    out: dict = {}
    counts: dict[tuple[str, str], int] = {}
    phase: list[str | None] = [None]
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if phase[0] is not None:
                counts[(phase[0], name)] = counts.get((phase[0], name), 0) + 1
            return originals[name](*args, **kwargs)
        return call

    def on_micro_batch(event: str, last: bool) -> None:
        phase[0] = ("final" if last else "accum") if event == "begin" else None

    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        for dp, ep in ((2, 1), (2, 2)):
            counts.clear()
            out[f"dp{dp}_ep{ep}"] = _run(shrunk_tiny(dp, ep), tokens, on_micro_batch)
            out[f"dp{dp}_ep{ep}"]["counts"] = dict(counts)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    out["fsdp_dp2"] = _run(shrunk_tiny(2, 1, strategy="fsdp"), tokens)
    dist.destroy_process_group()
    return out
