"""The seam between the training loop and how it is parallelised.

The loop talks only to a `Runtime`: it never calls torch.distributed itself. `LocalRuntime`
is one process; the distributed runtime (DDP / expert parallelism / distributed optimizer)
implements the same calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn

from moe_train.config import Config, ConfigError
from moe_train.trainer.schedule import param_groups


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool  # non-finite gradients: the update was not applied


class FlatRange(NamedTuple):
    """Elements [start, start + length) of the row-major flattened global tensor."""

    start: int
    length: int


Slice = tuple[tuple[int, int], ...] | FlatRange  # per-dim (offset, length), or a flat range


class CheckpointShard(NamedTuple):
    """One tensor (or part of one) this rank holds; is_writer: the one rank that writes it.

    Names: model parameters by their full-model name (global shapes, e.g. experts [E, ...]);
    optimizer state as optim.{param}.master / .exp_avg / .exp_avg_sq, the parameter's AdamW step
    count as optim.{param}.step (0-dim: a parameter left without a gradient on a step keeps its
    count), and optim.step, the steps taken (checkpoints of moe-train <= 0.5 hold only this one).
    same_as: the name of another of this rank's shards holding the very same values (an fp32
    master that is the parameter itself): saved once, under that name, and read back from it.
    """

    global_name: str
    global_shape: tuple[int, ...]
    slice: Slice
    tensor: torch.Tensor
    is_writer: bool
    same_as: str | None = None


class Runtime(Protocol):
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    def setup(self, model: nn.Module) -> nn.Module:
        """Place (or materialise) the model for training and apply the training-runtime choices the
        model itself does not hold: parallelism, train.activation_checkpointing."""
        ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None: ...

    def step(self, lr: float) -> StepResult: ...

    def discard_gradients(self) -> None:
        """Drop this step's gradients without an update (a non-finite loss); the next backward starts afresh."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def barrier(self) -> None: ...

    def background_barrier(self) -> Callable[[], None]:
        """A barrier a background thread may call (the async checkpoint writer): it never interleaves
        with the loop's collectives and fails after parallel.collective_timeout_s."""
        ...

    def checkpoint_shards(self) -> list[CheckpointShard]: ...

    def load_checkpoint_shards(self, read_fn: Callable[[str, Slice], torch.Tensor]) -> None: ...

    def close(self) -> None: ...


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module, device: torch.device, seed: int, expert_row_offsets: dict[str, int] | None = None) -> nn.Module:
    """Allocate a meta-device model's (possibly expert-sliced) tensors on `device` and draw its
    initial values: the same values, slice for slice, as the whole model built with that seed."""
    model.to_empty(device=device)
    model.reset_parameters(seed, expert_row_offsets)
    return model


def set_training_choices(model: nn.Module, cfg: Config) -> None:
    """Hand the model the training-runtime choices it carries out itself (a runtime's setup, before any memory is
    allocated): train.activation_checkpointing, train.compile, train.loss_chunk_tokens and train.lm_z_loss_weight.
    A model without the setter (not a Transformer) trains only with the default."""
    t = cfg.train
    for setter, name, value, default in (
        ("set_activation_checkpointing", "activation_checkpointing", t.activation_checkpointing, "none"),
        ("set_compile", "compile", t.compile, False),
        ("set_loss_chunk_tokens", "loss_chunk_tokens", t.loss_chunk_tokens, 0),
        ("set_lm_z_loss_weight", "lm_z_loss_weight", t.lm_z_loss_weight, 0.0),
    ):
        if hasattr(model, setter):
            getattr(model, setter)(value)
        elif value != default:
            raise ConfigError(f"train.{name}={value!r}: expected {default!r} for a {type(model).__name__} "
                              f"(it has no {setter})")


class LocalRuntime:
    """One process, one device: plain AdamW over the model's fp32 parameters."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.AdamW | None = None

    def setup(self, model: nn.Module) -> nn.Module:
        """model: built (moved to the device), or on the meta device (materialised there and
        initialised from train.seed)."""
        t = self.cfg.train
        set_training_choices(model, self.cfg)
        self.model = materialize(model, self.device, t.seed) if is_meta(model) else model.to(self.device)
        self.optimizer = torch.optim.AdamW(
            param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
            fused=True,  # one kernel for the whole update (CUDA and CPU): the single-GPU capacity tax
        )
        return self.model

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        loss.backward()

    def step(self, lr: float) -> StepResult:
        assert self.model is not None and self.optimizer is not None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm_value = float(torch.nn.utils.get_total_norm(grads))  # the one host read of the step
        skipped = not math.isfinite(norm_value)
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # Clipping as torch.nn.utils.clip_grad_norm_, folded into the fused update: the kernel divides each
            # gradient by grad_scale as it reads it, instead of a separate pass that rewrites every gradient.
            clip = self.cfg.train.grad_clip
            coef = clip / (norm_value + 1e-6) if clip > 0 else 1.0
            self.optimizer.grad_scale = (  # read by torch's fused AdamW (the attribute GradScaler sets)
                torch.tensor(1.0 / coef, dtype=torch.float32, device=self.device) if coef < 1.0 else None
            )
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(norm_value, skipped)

    def discard_gradients(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass

    def background_barrier(self) -> Callable[[], None]:
        return self.barrier

    def _adam_state(self, p: torch.Tensor) -> dict:
        assert self.optimizer is not None
        st = self.optimizer.state[p]
        if not st:
            st.update(step=torch.zeros((), dtype=torch.float32, device=self._step_device(p)),
                      exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        return st

    def _step_device(self, p: torch.Tensor) -> torch.device:
        """Fused AdamW keeps its step counts on the parameter's device, the others on the CPU."""
        return p.device if self.device.type == "cuda" else torch.device("cpu")

    def checkpoint_shards(self) -> list[CheckpointShard]:
        """Everything is whole on one process; the master weight is the parameter itself (saved once)."""
        assert self.model is not None
        out: list[CheckpointShard] = []
        steps = []
        for name, p in self.model.named_parameters():
            whole = tuple((0, n) for n in p.shape)
            st = self._adam_state(p)
            step = st["step"].detach().reshape(()).float().cpu()
            steps.append(step)
            out.append(CheckpointShard(name, tuple(p.shape), whole, p.data, True))
            out.append(CheckpointShard(f"optim.{name}.master", tuple(p.shape), whole, p.data, True, same_as=name))
            out.append(CheckpointShard(f"optim.{name}.exp_avg", tuple(p.shape), whole, st["exp_avg"], True))
            out.append(CheckpointShard(f"optim.{name}.exp_avg_sq", tuple(p.shape), whole, st["exp_avg_sq"], True))
            out.append(CheckpointShard(f"optim.{name}.step", (), (), step, True))
        # steps taken: a parameter that got a gradient on every step has them all
        out.append(CheckpointShard("optim.step", (), (), torch.stack(steps).max() if steps else torch.zeros(()), True))
        return out

    @torch.no_grad()
    def load_checkpoint_shards(self, read_fn: Callable[[str, Slice], torch.Tensor]) -> None:
        assert self.model is not None
        for name, p in self.model.named_parameters():
            whole = tuple((0, n) for n in p.shape)
            p.copy_(read_fn(f"optim.{name}.master", whole).reshape(p.shape))
            st = self._adam_state(p)
            st["exp_avg"].copy_(read_fn(f"optim.{name}.exp_avg", whole).reshape(p.shape))
            st["exp_avg_sq"].copy_(read_fn(f"optim.{name}.exp_avg_sq", whole).reshape(p.shape))
            step = read_fn(f"optim.{name}.step", ()).reshape(()).float()
            st["step"] = step.to(self._step_device(p)).clone()

    def close(self) -> None:
        pass
