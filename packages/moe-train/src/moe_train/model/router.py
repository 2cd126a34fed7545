"""Top-k router: fp32 logits, softmax or sigmoid gating, balancing losses and health statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_train.config import RouterConfig


@dataclass
class RouterOutput:
    """expert_ids: [T, k] int64; weights: [T, k] fp32; aux_loss: weighted lb + z loss (scalar)."""

    expert_ids: torch.Tensor
    weights: torch.Tensor
    aux_loss: torch.Tensor


class Router(nn.Module):
    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        # The aux-loss-free bias shifts selection only, never the weights; it is state, so it is saved.
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=cfg.expert_bias)
        # Rows routed to each expert since the last bias update (the balancing signal).
        self.register_buffer("step_load", torch.zeros(num_experts), persistent=False)
        # Health statistics accumulated since the last `pop_health()`; all detached, all on device.
        self.register_buffer("stat_load", torch.zeros(num_experts), persistent=False)
        self.register_buffer("stat_prob", torch.zeros(num_experts), persistent=False)
        self.register_buffer("stat_scalars", torch.zeros(5), persistent=False)  # tokens, margin, lb, z, calls
        # Process group over which "global" balancing-loss counts are summed (set by the parallel runtime).
        self.lb_group: dist.ProcessGroup | None = None

    def _select(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        routing = self.cfg.routing
        t = scores.shape[0]
        if routing == "learned":
            return scores.topk(k, dim=-1).indices
        if routing == "random":
            return torch.rand(t, self.num_experts, device=scores.device).topk(k, dim=-1).indices
        flat = torch.arange(t * k, device=scores.device) % self.num_experts  # uniform: exactly balanced
        return flat.view(t, k)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x: [T, d] -> ids [T, k], weights [T, k] fp32, aux loss."""
        cfg, e, k = self.cfg, self.num_experts, self.cfg.top_k
        logits = F.linear(x.float(), self.weight.float())
        probs = logits.softmax(-1) if cfg.gating == "softmax" else logits.sigmoid()
        scores = probs.detach() + self.expert_bias if cfg.expert_bias else probs.detach()
        ids = self._select(scores, k)
        weights = probs.gather(1, ids)
        if cfg.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)

        counts = torch.zeros(e, device=x.device, dtype=torch.float32)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device))
        # P_e: mean routing probability; sigmoid scores are normalised per token to be comparable with f_e.
        p = probs if cfg.gating == "softmax" else probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
        p_mean = p.mean(0)
        f = counts / ids.numel()
        if cfg.lb_loss_scope == "global" and self.lb_group is not None and dist.is_initialized():
            f_global = counts.clone()
            dist.all_reduce(f_global, group=self.lb_group)
            f = f_global / f_global.sum().clamp_min(1)
        lb = e * (f * p_mean).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        aux = cfg.lb_loss_weight * lb + cfg.z_loss_weight * z

        if not self.training:
            return RouterOutput(ids, weights, aux)
        with torch.no_grad():
            self.step_load += counts
            self.stat_load += counts
            self.stat_prob += p.sum(0)
            if k < e:
                top = scores.topk(k + 1, dim=-1).values
                margin = (top[:, k - 1] - top[:, k]).sum()
            else:
                margin = torch.zeros((), device=x.device)
            self.stat_scalars += torch.stack(
                [torch.tensor(float(x.shape[0]), device=x.device), margin, lb.detach(), z.detach(),
                 torch.ones((), device=x.device)]
            )
        return RouterOutput(ids, weights, aux)

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor | None = None) -> None:
        """Nudge under-loaded experts up and over-loaded ones down (aux-loss-free balancing).

        load: [E] rows per expert over the step (already summed across ranks); defaults to step_load.
        """
        load = self.step_load if load is None else load
        if self.cfg.expert_bias:
            self.expert_bias += self.cfg.expert_bias_rate * torch.sign(load.mean() - load)
        self.step_load.zero_()

    @torch.no_grad()
    def pop_health(self) -> dict[str, float | list[float]]:
        """Router health since the last call, from one scope: hard fraction f and soft probability P per expert."""
        tokens, margin, lb, z, calls = self.stat_scalars.tolist()
        load = self.stat_load.clone()
        prob = self.stat_prob.clone()
        self.stat_load.zero_()
        self.stat_prob.zero_()
        self.stat_scalars.zero_()
        if tokens == 0:
            return {}
        f = load / load.sum().clamp_min(1)
        p = prob / tokens
        mean_load = load.mean().clamp_min(1e-20)
        return {
            "f": [round(v, 5) for v in f.tolist()],
            "P": [round(v, 5) for v in p.tolist()],
            "max_over_mean_load": float(load.max() / mean_load),
            "dead_experts": int((load == 0).sum()),
            "topk_margin": margin / tokens,
            "lb_loss": lb / calls,
            "z_loss": z / calls,
        }
