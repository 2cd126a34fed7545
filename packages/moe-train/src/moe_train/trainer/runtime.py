"""The seam between the training loop and how it is parallelised.

The loop talks only to a `Runtime`: it never calls torch.distributed itself. `LocalRuntime`
is one process; the distributed runtime (DDP / expert parallelism / distributed optimizer)
implements the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from moe_train.config import Config
from moe_train.trainer.schedule import param_groups


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool  # non-finite gradients: the update was not applied


class Runtime(Protocol):
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    def setup(self, model: nn.Module) -> nn.Module: ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None: ...

    def step(self, lr: float) -> StepResult: ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def barrier(self) -> None: ...

    def optimizer_state(self) -> dict[str, torch.Tensor]: ...

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None: ...

    def close(self) -> None: ...


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
        t = self.cfg.train
        self.model = model.to(self.device)
        self.optimizer = torch.optim.AdamW(
            param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
            foreach=self.device.type == "cuda",
        )
        return self.model

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        loss.backward()

    def step(self, lr: float) -> StepResult:
        assert self.model is not None and self.optimizer is not None
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.train.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norm_value = float(norm)
        skipped = not torch.isfinite(norm).item()
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(norm_value, skipped)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW moments and step counts keyed by parameter name (global, unsharded tensors)."""
        assert self.model is not None and self.optimizer is not None
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            st = self.optimizer.state.get(p)
            if st:
                out[f"{name}.exp_avg"] = st["exp_avg"]
                out[f"{name}.exp_avg_sq"] = st["exp_avg_sq"]
                out[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
        return out

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        assert self.model is not None and self.optimizer is not None
        for name, p in self.model.named_parameters():
            if f"{name}.exp_avg" not in state:
                continue
            self.optimizer.state[p] = {
                "exp_avg": state[f"{name}.exp_avg"].to(p.device, p.dtype).clone(),
                "exp_avg_sq": state[f"{name}.exp_avg_sq"].to(p.device, p.dtype).clone(),
                "step": state[f"{name}.step"].reshape(()).to(torch.float32).clone(),
            }

    def close(self) -> None:
        pass
