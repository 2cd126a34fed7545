"""The CLI edge of parallelism: read the launcher's environment once and build the Runtime.

This is the only place that reads RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun); everything
below it receives plain values and process-group objects.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_kernels.triton import triton_available, triton_can_run_on
from moe_parallel import ParallelLayout, build_groups
from moe_train.config import Config, ConfigError
from moe_train.trainer.distributed_runtime import DistributedRuntime
from moe_train.trainer.runtime import LocalRuntime, Runtime


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda': expected a visible CUDA GPU, found none")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_gemm_backend(cfg: Config, device: torch.device) -> None:
    """model.gemm_backend='triton' where its kernels cannot run, refused by the field's name before the process
    group, the data or the run folder (moe-kernels refused it at the first forward, naming its own argument)."""
    if cfg.model.gemm_backend != "triton" or cfg.model.num_experts == 0:
        return
    if not triton_available():
        raise ConfigError("model.gemm_backend='triton': triton does not import here; expected 'auto', 'torch' or "
                          "'reference', or install triton")
    # a CUDA device runs them; the probe tensor is made only off CUDA (on CUDA it would open a context on GPU 0
    # in every torchrun rank, before each rank picks its own GPU)
    if device.type != "cuda" and not triton_can_run_on(torch.empty(0, device=device)):
        raise ConfigError(f"model.gemm_backend='triton': expected 'auto', 'torch' or 'reference' on the "
                          f"{device.type} (train.device={cfg.train.device!r}): the Triton kernels run on CUDA GPUs, "
                          "or on the CPU under Triton's interpreter (TRITON_INTERPRET=1)")


def _launch_env(name: str, default: str) -> int:
    """An integer the launcher (torchrun) set in the environment; one that is not is refused naming it, before any
    process group (int() raised a ValueError traceback)."""
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} in the environment: expected an integer (torchrun sets it; unset it to "
                          "run one process)") from None


def launched_world_size() -> int:
    return _launch_env("WORLD_SIZE", "1")


def launched_rank() -> int:
    return _launch_env("RANK", "0")


# moe_parallel's names for what the config calls parallel.dp / ep / pp and model.num_experts
_LAYOUT_NAMES = re.compile(r"(?<![\w.])(dp|ep|pp|num_experts)=")


def _check_layout(cfg: Config, layout: ParallelLayout, world: int) -> None:
    """The layout against the launched world, refused in the names the user typed (parallel.dp=3): moe_parallel's
    ParallelLayout names its own arguments (dp=3), as a library user passes them. The same one line on every rank,
    before any process group exists."""
    p = cfg.parallel
    try:
        layout.validate(world, cfg.model.num_experts)
    except ValueError as e:  # validate(cfg) refuses most of these first, in its own words; a Config built by hand
        # gets here. A dp, ep or pp of 0 or '2' is named below as moe_parallel words it, not multiplied (pp=0 was a
        # ZeroDivisionError); among counts, the one check validate(cfg) cannot make: it does not know the world
        counts = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (p.dp, p.ep, p.pp))
        if counts and p.dp * p.pp != world:
            processes = p.dp * p.pp
            fix = (f"set parallel.dp={world // p.pp}" if world % p.pp == 0 else
                   f"no parallel.dp fits parallel.pp={p.pp}: set parallel.pp to a divisor of {world}")
            raise ConfigError(f"parallel layout: parallel.dp={p.dp} x parallel.pp={p.pp} = {processes} does not "
                              f"equal world_size={world} (the processes launched, WORLD_SIZE); {fix}, or launch "
                              f"{processes} processes") from None
        message = str(e).removeprefix("parallel layout: ")
        names = _LAYOUT_NAMES.sub(lambda m: ("model." if m[1] == "num_experts" else "parallel.") + m[0], message)
        raise ConfigError(f"parallel layout: {names}") from None


def make_runtime(cfg: Config, device: torch.device) -> Runtime:
    """LocalRuntime for a plain single-process run, else a DistributedRuntime.

    The layout is validated against the launched world size before the process group, the
    model or any buffer exists, so a bad layout raises the same ValueError on every rank.
    device: the resolved device type; under torchrun on GPUs the index becomes LOCAL_RANK.
    """
    check_gemm_backend(cfg, device)
    p = cfg.parallel
    world = launched_world_size()
    layout = ParallelLayout(p.dp, p.ep, p.pp)
    plain = ((p.dp, p.ep, p.pp) == (1, 1, 1) and p.strategy == "ddp" and p.expert_capacity_factor == 0
             and p.param_dtype == "fp32")
    if world == 1 and plain:
        return LocalRuntime(cfg, device)
    _check_layout(cfg, layout, world)
    if p.backend == "nccl" and device.type != "cuda":  # torch would fail inside init_process_group, with a traceback
        raise ConfigError(f"parallel.backend='nccl': expected 'gloo' or 'auto' on the {device.type} (train.device="
                          f"{cfg.train.device!r}): NCCL runs on CUDA GPUs only")
    rank = launched_rank()
    if device.type == "cuda":
        device = torch.device("cuda", _launch_env("LOCAL_RANK", "0"))
        torch.cuda.set_device(device)
    backend = p.backend if p.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    timeout = timedelta(seconds=p.collective_timeout_s)
    initialised_here = not dist.is_initialized()
    if initialised_here and world == 1 and "MASTER_PORT" not in os.environ:
        # a world of 1 launched without torchrun: nothing to meet, so an in-process store rather than a fixed
        # port (two such runs on one machine, e.g. one per GPU, both took 29500 and the second failed)
        dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world, timeout=timeout)
    elif initialised_here:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    try:
        groups = build_groups(layout, cfg.model.num_experts, timeout=timeout)
        param_dtype = torch.bfloat16 if p.param_dtype == "bf16" else None
        return DistributedRuntime(cfg, device, groups, param_dtype=param_dtype, owns_world=initialised_here)
    except BaseException:
        if initialised_here:  # the runtime that would close it does not exist
            dist.destroy_process_group()
        raise
